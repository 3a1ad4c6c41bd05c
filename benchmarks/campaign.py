"""Multi-GPU measurement campaign (issue 19): Figs. 8-11 at 2, 4 and 8 GPUs, two
network regimes, simulator re-validation.

    python benchmarks/campaign.py plan                      # parts, minutes, calls per GPU kind
    bash benchmarks/campaign.sh OUT fig8a-hi@8 fig9a@8      # on the GPU machine (NCCL env set)
    python benchmarks/campaign.py run OUT all --smoke --ranks 4   # CPU: gloo ranks, tiny grids
    python benchmarks/campaign.py run OUT report revalidate --from DIR ...   # CPU, afterwards

A part is ``NAME@W``: one figure's measurements at world size W (``report`` and
``revalidate`` take no W). Each part runs the existing benchmark scripts
(straggler.py, exposed_comm.py, scaling.py, interference.py, comm_bandwidth.py)
with >= 50 measured steps after warm-up and packs everything it wrote (reports,
raw per-step JSON lines, rank-0 traces) into one ``OUT/<part>-<tag>.tgz``: the
device returns at most 8 files per call. ``report`` (campaign_report.py) and
``revalidate`` (sim_validate.py over benchmarks/results plus every campaign
run) read those archives back, so they can run on the CPU after the fact.

Estimated minutes per part come from the step times measured on 1-4 H200s
(benchmarks/results, docs/LOG.md); see ``estimate_min``.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
STEPS, WARMUP = 60, 10  # 50 measured steps
NE_STEPS = 400
SIZES = (8, 4, 2)  # largest world size first
SOCKETS = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}
# Socket settings whose bandwidth the `bw` part measures ("slower connections").
SOCKET_VARIANTS = {
    "sockets": {},
    "sockets-1x1": {"NCCL_SOCKET_NTHREADS": "1", "NCCL_NSOCKS_PERTHREAD": "1"},
    "sockets-4x4": {"NCCL_SOCKET_NTHREADS": "4", "NCCL_NSOCKS_PERTHREAD": "4"},
}
BUDGET_MIN = 9.0  # one device call: 10 minutes, minus start-up and packing

# Step ms at W = 2, sync + none, h200-21k preset, batch 128 unless noted (2 x H200,
# 2026-11-29: straggler-2k-8k, scaling-8k / -21k T2017/T2030/T2042/T2050; 4k and 16k
# interpolated, batch 64 between the measured 32 and 128).
STEP_MS_W2 = {(2000, 128): 90, (4000, 128): 125, (8000, 128): 170, (16000, 128): 205,
              (21000, 128): 213, (21000, 32): 81, (21000, 64): 130, (8000, 64): 110}  # fmt: skip
SOCKET_EXPOSED_MS_W2 = 337.0  # 167 + 170 ms exposed emb/grad over sockets at W = 2 (issue 19)


def step_ms(uih: int, batch: int, w: int, sockets: bool = False) -> float:
    """Estimated step ms: +20 % per doubling of W (4 GPUs, none: 262 vs 212 ms
    measured), and over sockets the exposed AllToAll grows with the W - 1 peers
    sharing one host's loopback (an assumption: never measured above W = 2)."""
    base = STEP_MS_W2[(uih, batch)] * (1 + 0.2 * math.log2(max(w, 2) / 2))
    return base + (SOCKET_EXPOSED_MS_W2 * max(w - 1, 1) if sockets else 0.0)


def startup_s(w: int) -> float:
    """One `freescale train` launch beyond its steps: 14 s at W = 2, 19 s at 4
    (point_s minus steps x step ms in scaling-21k-2and4xH200-2026-11-29T2017)."""
    return 9.0 + 2.5 * w


@dataclass(frozen=True)
class Sweep:
    """One invocation of a sweep script (a grid of `freescale train` runs)."""

    script: str
    stem: str
    uih: tuple[int, ...] = (21000,)
    batch: tuple[int, ...] = (128,)
    modes: tuple[str, ...] = ("sync",)
    balance: tuple[str, ...] = ("none",)
    vary: tuple[str, ...] = ()
    sets: tuple[str, ...] = ()
    steps: int = STEPS
    warmup: int = WARMUP
    trace: bool = False

    def points(self) -> int:
        n = len(self.uih) * len(self.batch) * len(self.modes) * len(self.balance)
        return n * math.prod(len(v.split("=", 1)[1].split(",")) for v in self.vary)

    def minutes(self, w: int, sockets: bool) -> float:
        per = [
            startup_s(w) + (3 if self.trace else 0) + 1.05 * self.steps * step_ms(u, b, w, sockets)
            / 1000 for u in self.uih for b in self.batch
        ]  # fmt: skip
        return sum(per) / len(per) * self.points() / 60

    def argv(self, w: int, out: Path, smoke: bool) -> list[str]:
        uih, batch, balance, vary = self.uih, self.batch, self.balance, self.vary
        steps, warmup = self.steps, self.warmup
        if smoke:  # the demo preset on gloo ranks: one point per axis but modes (and the
            # first and last value of a --vary axis, so a report has a line to fit)
            uih, batch, balance = (64,), (max(2, batch[-1] // 32),), balance[-1:]
            vary = tuple(f"{k}={_csv(dict.fromkeys([v.split(',')[0], v.split(',')[-1]]))}"
                         for k, v in (x.split("=", 1) for x in vary))  # fmt: skip
            steps, warmup = 3, 1
        argv = [
            sys.executable, str(HERE / self.script), "--preset", "demo" if smoke else "h200-21k",
            "--nproc", str(w), "--max-uih", _csv(uih), "--batch", _csv(batch),
            "--modes", _csv(self.modes), "--balance", _csv(balance),
            "--steps", str(steps), "--warmup", str(warmup), "--out", str(out),
        ]  # fmt: skip
        if self.script == "exposed_comm.py" and not any(
            v.startswith("step_overlap=") for v in vary
        ):
            argv += ["--vary", "step_overlap=1"]  # else its default axis (1, 0.5, 0) joins in
        for v in vary:
            argv += ["--vary", v]
        for s in (*self.sets, *(("device=cpu",) if smoke else ())):
            argv += ["--set", s]
        if self.trace and not smoke:
            argv += ["--trace-steps", "40-41"]
        return argv


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    sweeps: tuple[Sweep, ...] = ()
    sockets: bool = False
    only_largest: bool = False  # run once, at the machine's largest world size
    extra_min: float = 0.0  # commands that are not sweeps (interference, bandwidth)
    fixed_w: int | None = None
    notes: tuple[str, ...] = field(default=())

    def minutes(self, w: int) -> float:
        return sum(s.minutes(self.fixed_w or w, self.sockets) for s in self.sweeps) + (
            self.extra_min * (1 + 0.1 * math.log2(max(w, 2) / 2))
        )


FS_SMFREE = ("comm_overlapped=smfree",)
PARTS = {
    p.name: p
    for p in (
        Part("fig8a-lo", "Fig. 8a: straggler %, step time vs max UIH 2k-8k, B 128", (
            Sweep("straggler.py", "fig8a-lo", uih=(2000, 4000, 8000),
                  balance=("none", "fbs", "cost"), trace=True),)),
        Part("fig8a-hi", "Fig. 8a: straggler %, step time vs max UIH 16k, 21k, B 128", (
            Sweep("straggler.py", "fig8a-hi", uih=(16000, 21000),
                  balance=("none", "fbs", "cost"), trace=True),)),
        Part("fig8b", "Fig. 8b: straggler % vs batch 32, 64 at 21k (128: fig8a-hi)", (
            Sweep("straggler.py", "fig8b", batch=(32, 64), balance=("none", "fbs", "cost")),)),
        Part("fig9a", "Fig. 9a: exposed ids/emb/grad of sync/sdd/freescale vs max UIH", (
            Sweep("exposed_comm.py", "fig9a", uih=(2000, 8000, 21000),
                  modes=("sync", "sdd", "freescale")),)),
        Part("fig9b", "Fig. 9b: exposed comm vs collision 0-21 % (step_overlap), 21k B 128", (
            Sweep("exposed_comm.py", "fig9b-fs", modes=("freescale",),
                  vary=("step_overlap=0,0.25,0.5,1",)),
            Sweep("exposed_comm.py", "fig9b-base", modes=("sync", "sdd"),
                  vary=("step_overlap=0,1",)),)),
        Part("fig9c", "Fig. 9b continued: collision 27-50 % (zipf_alpha), same id volume", (
            Sweep("exposed_comm.py", "fig9c-fs", modes=("freescale",),
                  vary=("zipf_alpha=1.2,1.6,1.8",)),
            Sweep("exposed_comm.py", "fig9c-base", modes=("sync",), vary=("zipf_alpha=1.8",)),)),
        Part("fig10", "Fig. 10: attention/GEMM/memory-bound alone vs beside the AllToAll",
             extra_min=3.0),
        Part("fig11", "Fig. 11: sync / sdd / freescale (balanced, SM-free), trace idle %", (
            Sweep("scaling.py", "fig11-base", modes=("sync", "sdd"), trace=True),
            Sweep("scaling.py", "fig11-fs", modes=("freescale",),
                  balance=("none", "fbs", "cost"), sets=FS_SMFREE, trace=True),
            Sweep("scaling.py", "fig11-fs-nccl", modes=("freescale",), balance=("fbs",),
                  trace=True),)),
        Part("fig11-w1", "Fig. 11: the W = 1 baseline of weak-scaling efficiency", (
            Sweep("scaling.py", "fig11-w1", modes=("sync", "sdd", "freescale")),),
            fixed_w=1, only_largest=True),
        Part("fig11-ne", f"Fig. 11 bottom: NE vs step, {NE_STEPS} steps, h200 data at 8k B 64", (
            Sweep("scaling.py", "fig11-ne-base", uih=(8000,), batch=(64,), modes=("sync", "sdd"),
                  steps=NE_STEPS),
            Sweep("scaling.py", "fig11-ne-fs", uih=(8000,), batch=(64,), modes=("freescale",),
                  balance=("fbs",), steps=NE_STEPS)), only_largest=True),
        Part("bw", "Point 5: link bandwidth, NCCL over NVLink and over sockets", extra_min=2.5),
        Part("sock9", "Point 5: Fig. 9 over sockets (21k, collision 21 %)", (
            Sweep("exposed_comm.py", "sock9", modes=("sync", "freescale")),), sockets=True),
        Part("sock9b", "Point 5: Fig. 9b over sockets (freescale at collision 0 %)", (
            Sweep("exposed_comm.py", "sock9b", modes=("freescale",), vary=("step_overlap=0",)),),
            sockets=True),
        Part("sock11", "Point 5: Fig. 11 over sockets (sync, sdd)", (
            Sweep("scaling.py", "sock11-base", modes=("sync", "sdd"), trace=True),),
            sockets=True),
        Part("sock11-fs", "Point 5: Fig. 11 over sockets (freescale, fbs, SM-free)", (
            Sweep("scaling.py", "sock11-fs", modes=("freescale",), balance=("fbs",),
                  sets=FS_SMFREE, trace=True),), sockets=True),
    )
}  # fmt: skip
FINAL = ("report", "revalidate")  # CPU only: they read the archives back


def _csv(values) -> str:
    return ",".join(str(v) for v in values)


def parts_for(gpus: int) -> list[tuple[str, int]]:
    """Every (part, W) a machine of ``gpus`` GPUs allows, largest W first."""
    sizes = [w for w in SIZES if w <= gpus]
    out = [(p.name, w) for w in sizes for p in PARTS.values() if not p.only_largest]
    return out + [(p.name, sizes[0]) for p in PARTS.values() if p.only_largest and sizes]


def calls_for(gpus: int) -> list[list[tuple[str, int, float]]]:
    """Parts grouped into device calls of at most BUDGET_MIN minutes (in order)."""
    calls: list[list[tuple[str, int, float]]] = []
    for name, w in parts_for(gpus):
        m = PARTS[name].minutes(w)
        if calls and sum(x[2] for x in calls[-1]) + m <= BUDGET_MIN and len(calls[-1]) < 7:
            calls[-1].append((name, w, m))
        else:
            calls.append([(name, w, m)])
    return calls


def plan_text(kinds: tuple[int, ...] = (2, 4, 8)) -> str:
    lines = []
    for g in kinds:
        calls = calls_for(g)
        total = sum(m for c in calls for *_, m in c)
        lines += ["", f"### nvidia-h200-x{g}: {len(calls)} calls, ~{total:.0f} min of runs", "",
                  "| call | parts (estimated minutes) | command |", "|---|---|---|"]  # fmt: skip
        for k, c in enumerate(calls, 1):
            parts = ", ".join(f"`{n}@{w}` ({m:.1f})" for n, w, m in c)
            cmd = "bash benchmarks/campaign.sh $OUT " + " ".join(f"{n}@{w}" for n, w, _ in c)
            lines.append(f"| {k} | {parts} | `{cmd}` |")
    return "\n".join(lines)


# ---- running ----------------------------------------------------------------------------
def tag(w: int, smoke: bool) -> str:
    return f"{w}cpu" if smoke else f"{w}xH200"


def sh(argv: list[str], env: dict[str, str], log: Path, timeout: float) -> int:
    """Run one command, its output appended to ``log``; rc (124 on a timeout)."""
    with log.open("a") as f:
        f.write(f"$ {' '.join(f'{k}={v}' for k, v in env.items())} {' '.join(argv)}\n")
        f.flush()
        try:
            done = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env={**os.environ, **env}, timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            f.write(f"TIMEOUT after {timeout:.0f} s\n")
            return 124
    return done.returncode


def torchrun(w: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={w}"]  # fmt: skip


def run_part(name: str, w: int, out: Path, smoke: bool, timeout: float) -> int:
    part = PARTS[name]
    w = part.fixed_w or w
    label = f"{name}-{tag(w, smoke)}"
    work = out / label
    work.mkdir(parents=True, exist_ok=True)
    log = work / f"{label}.log"
    env = dict(SOCKETS) if part.sockets else {}
    rc = 0
    for s in part.sweeps:
        rc |= sh(s.argv(w, work / f"{s.stem}-{tag(w, smoke)}", smoke), env, log, timeout)
    if name == "fig10":
        rc |= sh(fig10_argv(w, work / f"fig10-{tag(w, smoke)}", smoke), env, log, timeout)
    if name == "bw":
        regimes = {"nvlink": {}, **{k: {**SOCKETS, **v} for k, v in SOCKET_VARIANTS.items()}}
        for regime, extra in regimes.items():
            if smoke and regime != "nvlink" and regime != "sockets":
                continue
            md = work / f"bw-{regime}-{tag(w, smoke)}.md"
            rc |= sh(bw_argv(w, md, smoke), extra, log, timeout)
    pack(work, out / f"{label}.tgz")
    return rc


def fig10_argv(w: int, out: Path, smoke: bool) -> list[str]:
    if smoke:
        return [*torchrun(w), str(HERE / "interference.py"), "--device", "cpu",
                "--backgrounds", "nccl,smfree", "--uih", "64", "--dims", "32", "--tokens", "512",
                "--gemm", "128", "--membound-bytes", str(1 << 20), "--bytes", str(1 << 16),
                "--reps", "3", "--out", str(out)]  # fmt: skip
    # The step's embedding AllToAll at 21k, B 128 is ~0.6 GB per rank (ids x 256 fp32):
    # 256 MiB rounds keep the background busy without dominating memory.
    return [*torchrun(w), str(HERE / "interference.py"), "--backgrounds",
            "host,smcopy,nccl,smfree", "--uih", "4000,21000", "--dims", "512,1024",
            "--out", str(out)]  # fmt: skip


def bw_argv(w: int, md: Path, smoke: bool) -> list[str]:
    if smoke:
        return [sys.executable, str(HERE / "comm_bandwidth.py"), "--world-size", str(w),
                "--backends", "torch", "--max-bytes", str(16 << 10), "--target-s", "0.02",
                "--out", str(md)]  # fmt: skip
    return [*torchrun(w), str(HERE / "comm_bandwidth.py"), "--device", "cuda",
            "--backends", "torch", "--target-s", "0.5", "--out", str(md)]  # fmt: skip


def pack(work: Path, tgz: Path) -> None:
    """One archive per part; rank-0 traces only (the others are large and redundant)."""
    for extra in work.glob("*-steps/*.rank[1-9]*.json.gz"):
        extra.unlink()
    with tarfile.open(tgz, "w:gz") as t:
        for p in sorted(work.iterdir()):
            t.add(p, arcname=p.name)
    shutil.rmtree(work)


def unpack_all(sources: list[Path], dest: Path) -> list[Path]:
    """Every part archive under ``sources`` unpacked flat into ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    found = []
    for src in sources:
        for tgz in sorted(src.glob("*.tgz")):
            with tarfile.open(tgz) as t:
                t.extractall(dest, filter="data")
            found.append(tgz)
    return found


def revalidate(out: Path, sources: list[Path], day: str) -> int:
    """sim_validate.py over benchmarks/results plus every campaign run (its
    CPU-tagged runs are listed there as skipped)."""
    merged = out / "revalidate-input"
    for p in (ROOT / "benchmarks" / "results").iterdir():
        (merged / p.name).parent.mkdir(parents=True, exist_ok=True)
        if not (merged / p.name).exists():
            (merged / p.name).symlink_to(p)
    unpack_all(sources, merged)
    log = out / f"sim-validation-{day}.log"
    rc = sh([sys.executable, str(HERE / "sim_validate.py"), "--results", str(merged),
             "--date", day], {}, log, 900)  # fmt: skip
    for f in merged.glob(f"sim-*-{day}.*"):
        shutil.move(str(f), out / f.name)
    shutil.rmtree(merged)
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    pl = sub.add_parser("plan", help="parts, estimated minutes and device calls per GPU kind")
    pl.add_argument("--gpus", type=int, action="append", help="GPU count (default 2, 4, 8)")
    rn = sub.add_parser("run", help="run parts NAME@W (or 'all'), then report / revalidate")
    rn.add_argument("out", type=Path)
    rn.add_argument("parts", nargs="+")
    rn.add_argument("--smoke", action="store_true", help="CPU, gloo ranks, tiny grids")
    rn.add_argument("--ranks", type=int, default=2, help="--smoke: world size of every part")
    rn.add_argument(
        "--from",
        dest="sources",
        type=Path,
        action="append",
        default=[],
        help="more folders with part archives for report / revalidate",
    )
    rn.add_argument("--timeout", type=float, default=590, help="seconds per command")
    rn.add_argument("--date", default=str(date.today()))
    args = ap.parse_args(argv)
    if args.cmd == "plan":
        print(plan_text(tuple(args.gpus or (2, 4, 8))))
        return 0
    try:
        todo = resolve(args.parts, args)
    except ValueError as e:
        print(f"campaign: {e}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    for name, w in todo:
        start = time.perf_counter()
        if name == "report":
            from campaign_report import write_report  # benchmarks/ is on the path

            rc = write_report(args.out, [args.out, *args.sources], f"{args.date}")
        elif name == "revalidate":
            rc = revalidate(args.out, [args.out, *args.sources], args.date)
        else:
            rc = run_part(name, w, args.out, args.smoke, args.timeout)
        took = (time.perf_counter() - start) / 60
        est = f", estimated {PARTS[name].minutes(w):.1f}" if name in PARTS else ""
        print(f"[campaign] {name}@{w}: rc {rc}, {took:.1f} min{est}", flush=True)
        status |= rc != 0
    return status


def resolve(names: list[str], args: argparse.Namespace) -> list[tuple[str, int]]:
    """``NAME@W`` / ``all`` into (part, W) pairs; one-line errors for bad names."""
    if names == ["all"]:
        if not args.smoke:
            import torch

            return [*parts_for(torch.cuda.device_count()), *((n, 0) for n in FINAL)]
        return [(n, args.ranks) for n in PARTS] + [(n, 0) for n in FINAL]
    out = []
    for item in names:
        name, _, w = item.partition("@")
        if name in FINAL:
            out.append((name, 0))
            continue
        if name not in PARTS:
            raise ValueError(f"unknown part {name!r}; parts: {', '.join([*PARTS, *FINAL])}")
        if args.smoke:
            out.append((name, int(w) if w else args.ranks))
        elif not w.isdigit() and PARTS[name].fixed_w is None:
            raise ValueError(f"part {item!r} needs a world size, e.g. {name}@2")
        else:
            out.append((name, int(w) if w else PARTS[name].fixed_w))
    return out


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
