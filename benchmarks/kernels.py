"""Jagged kernel benchmark (paper §4.2, Fig. 7): eager loops vs vectorized torch vs Triton.

Per world size W, at a fixed per-rank load (S samples x ~L ids, embedding rows
of dim D), each op is timed three ways: ``eager`` (the per-sample / per-rank
loop the paper compares against), ``torch`` (the vectorized reference) and
``triton``. Ops and their inputs:

  permute       keep this rank's S samples (3 int64 features) of the W*S all-gathered ones
  transpose     K keys x W*S samples (what an owner receives), feature- to batch-major
  bucketize     the rank's ids -> owner rank and local row (hashed sharding over W)
  dispatch_ids  ids grouped by owner, owners computed from the ids (send buffer of local rows)
  dispatch_emb  embedding rows [N, D] fp32 grouped by destination
  combine_emb   received rows [N, D] back to batch order
  collision     collision / exclusive split of two steps' unique rows on one shard

Triton and torch: `triton.testing.do_bench` medians. Eager: wall time between
device synchronizations, repeated while under ``--eager-budget`` seconds (at
least once, at most 5 times; the count is reported). Triton's GB/s counts the
minimum bytes each op must move (see the ``*_bytes`` helpers in
`freescale.kernels`), and is compared with a measured device-to-device copy
(``dst.copy_(src)`` of 1 GiB, read + write).

    python benchmarks/kernels.py                          # one GPU, < 4 minutes
    python benchmarks/kernels.py --ops dispatch_ids,dispatch_emb --dispatch-blocks sqrt
                                                          # the previous dispatch blocks
    python benchmarks/kernels.py --quick --device cpu     # seconds: torch vs eager only
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from freescale.jagged import ops  # noqa: E402
from freescale.jagged.tensor import JaggedFeatures  # noqa: E402
from freescale.kernels import (  # noqa: E402
    RowSharding,
    bucketize_by_shard,
    collision_split,
    indexed_permute,
    keyed_transpose,
    ranged_combine,
    ranged_dispatch,
    ranged_dispatch_ids,
)
from freescale.kernels.collision import collision_bytes  # noqa: E402
from freescale.kernels.combine import combine_bytes  # noqa: E402
from freescale.kernels.dispatch import dispatch_bytes  # noqa: E402
from freescale.kernels.permute import permute_bytes  # noqa: E402
from freescale.kernels.shard import bucketize_bytes  # noqa: E402

OPS = (
    "permute",
    "transpose",
    "bucketize",
    "dispatch_ids",
    "dispatch_emb",
    "combine_emb",
    "collision",
)
TARGET_OPS = ("dispatch_ids", "dispatch_emb", "combine_emb")
MB = 1 << 20


@dataclass(frozen=True)
class Sizes:
    samples: int = 128  # per rank
    mean_length: int = 4000  # ids per sample, uniform in [0, 2 * mean]
    dim: int = 128  # embedding row
    keys: int = 8  # transpose
    num_rows: int = 50_000_000  # table rows (id range)
    unique_rows: int = 300_000  # per shard and step (collision)


QUICK = Sizes(samples=4, mean_length=50, dim=8, keys=2, num_rows=10_000, unique_rows=500)


@dataclass
class Case:
    """One op at one world size: a zero-argument call per implementation."""

    op: str
    world_size: int
    nbytes: int  # minimum bytes moved (for GB/s)
    buffer_mb: float  # largest buffer the op reads or writes
    calls: dict[str, Callable[[], object]]


# ---- inputs -----------------------------------------------------------------
def rand_lengths(n: int, mean: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2 * mean + 1, (n,), generator=g)


def impls(fn: Callable[[str], object], names: tuple[str, ...]) -> dict[str, Callable[[], object]]:
    return {name: (lambda name=name: fn(name)) for name in names}


def build(op: str, w: int, sz: Sizes, dev: str, names: tuple[str, ...]) -> Case:
    g = torch.Generator().manual_seed(w)
    n_ids = sz.samples * sz.mean_length
    if op == "permute":
        lengths = rand_lengths(w * sz.samples, sz.mean_length, g)
        total_in = int(lengths.sum())
        feats = JaggedFeatures(
            ops.lengths_to_offsets(lengths).to(dev),
            {n: torch.randint(0, 2**40, (total_in,), device=dev) for n in ("ids", "act", "ts")},
        )
        pick = torch.randperm(w * sz.samples, generator=g)[: sz.samples]
        total = int(lengths[pick].sum())  # the balancer knows lengths on the host
        idx = pick.to(dev)

        def run(impl: str) -> object:
            return indexed_permute(feats, idx, None if impl == "eager" else total, impl=impl)

        nbytes = permute_bytes(feats, sz.samples, total)
        return Case(op, w, nbytes, total * 24 / MB, impls(run, names))
    if op == "transpose":
        batch = w * sz.samples
        mean = max(1, round(n_ids / (sz.keys * batch)))
        lengths = rand_lengths(sz.keys * batch, mean, g)
        total = int(lengths.sum())
        feats = JaggedFeatures(
            ops.lengths_to_offsets(lengths).to(dev),
            {"ids": torch.randint(0, 2**40, (total,), device=dev)},
        )
        nbytes = permute_bytes(feats, sz.keys * batch, total)
        run = lambda impl: keyed_transpose(feats, sz.keys, batch, impl=impl)  # noqa: E731
        return Case(op, w, nbytes, total * 8 / MB, impls(run, names))
    sharding = RowSharding(sz.num_rows, w, "hashed")
    ids = torch.randint(0, sz.num_rows, (n_ids,), generator=g).to(dev)
    if op == "bucketize":
        run = lambda impl: bucketize_by_shard(ids, sharding, impl=impl)  # noqa: E731
        return Case(op, w, bucketize_bytes(n_ids, 8), n_ids * 8 / MB, impls(run, names))
    if op == "dispatch_ids":
        run = lambda impl: ranged_dispatch_ids(ids, sharding, impl=impl)  # noqa: E731
        return Case(op, w, dispatch_bytes(ids, 0), n_ids * 8 / MB, impls(run, names))
    dest = bucketize_by_shard(ids, sharding, impl="torch")[0]
    rows = torch.randn(n_ids, sz.dim, device=dev)
    mb = rows.numel() * rows.element_size() / MB
    if op == "dispatch_emb":
        run = lambda impl: ranged_dispatch(rows, dest, w, impl=impl)  # noqa: E731
        return Case(op, w, dispatch_bytes(rows, 8), mb, impls(run, names))
    if op == "combine_emb":
        plan = ranged_dispatch(dest, dest, w, impl="torch")[1]
        run = lambda impl: ranged_combine(rows, plan, impl=impl)  # noqa: E731
        return Case(op, w, combine_bytes(rows), mb, impls(run, names))
    if op == "collision":
        universe = torch.randperm(4 * sz.unique_rows, generator=g)
        u, shared = sz.unique_rows, int(0.3 * sz.unique_rows)
        now = torch.unique(universe[:u]).to(dev)
        nxt = torch.unique(torch.cat([universe[:shared], universe[u : 2 * u - shared]])).to(dev)
        run = lambda impl: collision_split(now, nxt, impl=impl)  # noqa: E731
        nbytes = collision_bytes(now.numel(), nxt.numel(), 8)
        return Case(op, w, nbytes, u * 8 / MB, impls(run, names))
    raise ValueError(f"unknown op {op!r}")


# ---- outputs compared -------------------------------------------------------
def flat(out: object) -> list[torch.Tensor]:
    """Every tensor of an op's output, in a fixed order."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, JaggedFeatures):
        return [out.offsets, *out.features.values()]
    if isinstance(out, tuple | list):
        return [t for o in out for t in flat(o)]
    if hasattr(out, "now_to_next"):  # CollisionSplit
        return [out.now_to_next, out.next_to_now]
    return [out.counts, out.offsets, out.positions]  # DispatchPlan


def same(a: object, b: object) -> bool:
    fa, fb = flat(a), flat(b)
    return len(fa) == len(fb) and all(
        x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(fa, fb, strict=True)
    )


# ---- timing -----------------------------------------------------------------
def sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def time_loop(
    fn: Callable[[], object], dev: str, budget_s: float, max_reps: int
) -> tuple[float, int]:
    """Median ms of up to ``max_reps`` calls while under ``budget_s`` (at least one)."""
    times: list[float] = []
    while len(times) < max_reps and (not times or sum(times) < budget_s):
        sync(dev)
        start = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, len(times)


def time_fast(fn: Callable[[], object], dev: str) -> float:
    if dev == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm-up
    return time_loop(fn, dev, 0.5, 20)[0]


def gpu_kernel_ms(fn: Callable[[], object], reps: int = 20) -> tuple[float, list[list]]:
    """GPU time of ``fn``'s kernels and copies per call (profiler), and the 4 largest.

    Against ``do_bench``'s wall time this separates GPU work from launch
    overhead: an op whose kernels take 30 us but which measures 300 us is
    bound by the host launching it, not by memory bandwidth.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            per[e.name] = per.get(e.name, 0.0) + e.time_range.elapsed_us() / reps / 1000
    top = sorted(per.items(), key=lambda kv: -kv[1])[:4]
    return sum(per.values()), [[name[:60], round(ms, 4)] for name, ms in top]


def copy_gbps(dev: str, quick: bool) -> float:
    """Device-to-device copy bandwidth, read + write bytes."""
    n = (16 if quick else 1024) * MB
    src = torch.empty(n, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    ms = time_fast(lambda: dst.copy_(src), dev)
    return 2 * n / (ms * 1e-3) / 1e9


# ---- run, report ------------------------------------------------------------
def measure(case: Case, dev: str, args: argparse.Namespace, deadline: float) -> dict:
    row: dict = {
        "op": case.op,
        "world_size": case.world_size,
        "bytes": case.nbytes,
        "buffer_mb": round(case.buffer_mb, 2),
    }
    want = case.calls["torch"]()
    row["torch_ms"] = time_fast(case.calls["torch"], dev)
    if "triton" in case.calls:
        row["triton_ok"] = same(case.calls["triton"](), want)
        row["triton_ms"] = time_fast(case.calls["triton"], dev)
        if case.op in TARGET_OPS:
            row["triton_gpu_ms"], row["triton_kernels"] = gpu_kernel_ms(case.calls["triton"])
    if time.perf_counter() < deadline:
        row["eager_ok"] = same(case.calls["eager"](), want)
        row["eager_ms"], row["eager_reps"] = time_loop(
            case.calls["eager"], dev, args.eager_budget, 5
        )
    else:
        row["eager_ms"], row["eager_note"] = None, "skipped: past --time-limit"
    fast = row.get("triton_ms") or row["torch_ms"]
    if row["eager_ms"] is not None:
        row["eager_speedup"] = row["eager_ms"] / fast
    if "triton_ms" in row:
        row["torch_speedup"] = row["torch_ms"] / row["triton_ms"]
        row["triton_gbps"] = case.nbytes / (row["triton_ms"] * 1e-3) / 1e9
    return row


def targets(rows: list[dict], copy: float) -> list[dict]:
    """The issue's acceptance targets, checked against the measured rows."""
    out = []
    for r in rows:
        if r["op"] not in TARGET_OPS or "triton_ms" not in r:
            continue
        checks = [("vs torch >= 2x", r["torch_speedup"], 2.0)]
        goal = {32: 20.0, 512: 600.0}.get(r["world_size"])
        if goal and r.get("eager_speedup") is not None:
            checks.append((f"vs eager >= {goal:.0f}x", r["eager_speedup"], goal))
        if r["buffer_mb"] >= 64:
            checks.append((">= 50% copy BW", r["triton_gbps"] / copy, 0.5))
        for name, value, goal_value in checks:
            out.append(
                {
                    "op": r["op"],
                    "world_size": r["world_size"],
                    "target": name,
                    "value": round(value, 3),
                    "pass": value >= goal_value,
                }
            )
    return out


def dispatch_lines(rows: list[dict], copy: float, blocks: str) -> list[str]:
    """One line per dispatch op and W: % of copy bandwidth and x torch (issue 18's
    targets: >= 50% and >= 2x at every W up to 512)."""
    out = []
    for r in rows:
        if r["op"].startswith("dispatch") and "triton_gbps" in r:
            out.append(
                f"{r['op']} W={r['world_size']} ({blocks} blocks): "
                f"{100 * r['triton_gbps'] / copy:.1f}% of copy bandwidth, "
                f"{r['torch_speedup']:.2f}x torch, GPU {fmt(r.get('triton_gpu_ms'))} ms "
                f"of {r['triton_ms']:.3f} ms wall"
            )
    return out


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict], copy: float) -> list[str]:
    head = (
        "| op | W | MB | eager ms (reps) | torch ms | triton ms | eager/fast | torch/triton "
        "| triton GB/s | % copy | triton GPU ms | checks |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        gbps = r.get("triton_gbps")
        reps = f" ({r['eager_reps']})" if "eager_reps" in r else ""
        bad = [k.split("_")[0] for k in ("triton_ok", "eager_ok") if r.get(k) is False]
        cells = [
            r["op"],
            str(r["world_size"]),
            f"{r['buffer_mb']:.1f}",
            fmt(r["eager_ms"]) + reps,
            fmt(r["torch_ms"]),
            fmt(r.get("triton_ms")),
            fmt(r.get("eager_speedup"), ".1f"),
            fmt(r.get("torch_speedup"), ".2f"),
            fmt(gbps, ".0f"),
            fmt(None if gbps is None else 100 * gbps / copy, ".0f"),
            fmt(r.get("triton_gpu_ms")),
            "MISMATCH " + ",".join(bad) if bad else r.get("eager_note", "equal"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def machine(dev: str) -> dict:
    info = {
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": torch.get_num_threads(),
    }
    try:
        info["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        info["triton"] = None
    if dev == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    else:
        info["cpu"] = platform.processor() or platform.machine()
    return info


def report(path: Path, meta: dict, rows: list[dict], checks: list[dict]) -> None:
    lines = [
        f"# Jagged kernels benchmark ({meta['date']})",
        "",
        f"- command: `{meta['command']}`",
        f"- machine: {json.dumps(meta['machine'])}",
        f"- copy bandwidth (read + write): {meta['copy_gbps']:.0f} GB/s",
        f"- per-rank load: {json.dumps(meta['sizes'])}",
        f"- eager: repeated while under {meta['eager_budget']} s (at least 1, at most 5"
        " calls; count in parentheses); `eager/fast` divides by Triton, or by torch"
        " where Triton is not run",
        "- triton GPU ms: kernel and copy time per call from the profiler; the wall time"
        " (`triton ms`, `triton.testing.do_bench` median) above it is host launch overhead",
        "",
        *table(rows, meta["copy_gbps"]),
        "",
    ]
    kernels = [r for r in rows if r.get("triton_kernels")]
    if kernels:
        lines += ["## Triton kernels per call (profiler)", "", "| op | W | kernel | GPU ms |",
                  "|---|---|---|---|"]  # fmt: skip
        lines += [
            f"| {r['op']} | {r['world_size']} | `{name}` | {ms:.4f} |"
            for r in kernels
            for name, ms in r["triton_kernels"]
        ]
        lines.append("")
    if checks:
        lines += ["## Targets", "", "| op | W | target | value | pass |", "|---|---|---|---|---|"]
        lines += [
            f"| {c['op']} | {c['world_size']} | {c['target']} | {c['value']} |"
            f" {'PASS' if c['pass'] else 'MISS'} |"
            for c in checks
        ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    payload = {**meta, "results": rows, "targets": checks}
    path.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_dev = "cuda" if torch.cuda.is_available() else "cpu"
    p.add_argument("--device", choices=("cuda", "cpu"), default=default_dev)
    p.add_argument("--quick", action="store_true", help="tiny sizes, torch vs eager, seconds")
    p.add_argument("--world-sizes", default=None, help="comma-separated (default 8,32,128,512)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated subset of {OPS}")
    p.add_argument("--eager-budget", type=float, default=2.0, help="seconds per eager timing")
    p.add_argument("--time-limit", type=float, default=200.0, help="no eager runs after this")
    p.add_argument("--out", default=None, help="markdown path (JSON written beside it)")
    p.add_argument(
        "--dispatch-blocks",
        choices=("flat", "sqrt"),
        default="flat",
        help="ranged dispatch rows per program: flat (64 up to W=1024, the default) or "
        "sqrt (the previous sqrt(32 W) rule), to compare the two",
    )
    args = p.parse_args(argv)
    if args.world_sizes is None:
        args.world_sizes = "2,4" if args.quick else "8,32,128,512"
    args.world_list = [int(w) for w in args.world_sizes.split(",")]
    args.op_list = args.ops.split(",")
    if unknown := set(args.op_list) - set(OPS):
        p.error(f"unknown ops {sorted(unknown)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.perf_counter()
    deadline = start + args.time_limit
    dev, sizes = args.device, QUICK if args.quick else Sizes()
    names = ("eager", "torch", "triton") if dev == "cuda" and not args.quick else ("eager", "torch")
    if "triton" in names and args.dispatch_blocks == "sqrt":
        from freescale.kernels import triton_dispatch

        triton_dispatch.block_size = triton_dispatch.block_size_sqrt  # read at each launch
    copy = copy_gbps(dev, args.quick)
    print(f"device {dev}, copy bandwidth {copy:.0f} GB/s, impls {names}", flush=True)
    print(f"eager: timed while under {args.eager_budget} s per op (1 to 5 calls, count in"
          f" parentheses); no eager runs after {args.time_limit} s", flush=True)  # fmt: skip
    rows = []
    for w in args.world_list:
        for op in args.op_list:
            case = build(op, w, sizes, dev, names)
            rows.append(measure(case, dev, args, deadline))
            print("\n".join(table(rows[-1:], copy)[2:]), flush=True)
            del case
            if dev == "cuda":
                torch.cuda.empty_cache()
    checks = targets(rows, copy)
    date = dt.datetime.now().strftime("%Y-%m-%d")
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"kernels-{date}.md"
    meta = {
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(dev),
        "device": dev,
        "copy_gbps": copy,
        "sizes": sizes.__dict__,
        "eager_budget": args.eager_budget,
        "dispatch_blocks": args.dispatch_blocks,
        "seconds": round(time.perf_counter() - start, 1),
    }
    report(out, meta, rows, checks)
    print("\n".join(table(rows, copy)))
    for c in checks:
        print(
            f"target {c['op']} W={c['world_size']} {c['target']}: {c['value']}"
            f" {'PASS' if c['pass'] else 'MISS'}"
        )
    for line in dispatch_lines(rows, copy, args.dispatch_blocks):
        print(line)
    summary = {
        "benchmark": "kernels",
        "device": dev,
        "copy_gbps": round(copy, 1),
        "seconds": meta["seconds"],
        "report": str(out),
        "targets_passed": sum(c["pass"] for c in checks),
        "targets_total": len(checks),
        "results": [
            {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows
        ],
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
