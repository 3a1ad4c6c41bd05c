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

    python -m benchmarks run fig7              # one GPU, < 4 minutes
    python -m benchmarks run kernels           # the guard: targets at W = 32, 512
    python -m benchmarks run fig7 --smoke      # seconds on the CPU: torch vs eager only

Parameters (``[params]``): ``quick``, ``world_sizes``, ``ops``, ``eager_budget``
(s per eager timing), ``time_limit`` (s; no eager runs after it), ``targets``
(the target names ``targets_met`` counts; default every one).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from freescale.jagged import ops
from freescale.jagged.tensor import JaggedFeatures
from freescale.kernels import (
    RowSharding,
    bucketize_by_shard,
    collision_split,
    indexed_permute,
    keyed_transpose,
    ranged_combine,
    ranged_dispatch,
    ranged_dispatch_ids,
)
from freescale.kernels.collision import collision_bytes
from freescale.kernels.combine import combine_bytes
from freescale.kernels.dispatch import dispatch_bytes
from freescale.kernels.permute import permute_bytes
from freescale.kernels.shard import bucketize_bytes

from .runner import Ctx, Result
from .scenario import Scenario

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
def time_case(case: Case, dev: str, args: Any, deadline: float) -> dict:
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


def dispatch_lines(rows: list[dict], copy: float) -> list[str]:
    """One line per dispatch op and W: % of copy bandwidth and x torch (the
    targets: >= 50% and >= 2x at every W up to 512)."""
    out = []
    for r in rows:
        if r["op"].startswith("dispatch") and "triton_gbps" in r:
            out.append(
                f"{r['op']} W={r['world_size']} "
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


DEFAULTS = {"quick": False, "world_sizes": [8, 32, 128, 512], "ops": list(OPS),
            "eager_budget": 2.0, "time_limit": 200.0, "targets": None}  # fmt: skip


def measure(s: Scenario, ctx: Ctx) -> Result:
    """Every op at every world size; targets per row (``targets_met``)."""
    args = SimpleNamespace(**{**DEFAULTS, **s.params})
    if unknown := set(args.ops) - set(OPS):
        raise ValueError(f"unknown ops {sorted(unknown)}")
    dev = (
        "cuda" if s.device == "cuda" or (s.device == "any" and torch.cuda.is_available()) else "cpu"
    )
    quick = args.quick or ctx.smoke
    deadline = time.perf_counter() + args.time_limit
    sizes = QUICK if quick else Sizes()
    names = ("eager", "torch", "triton") if dev == "cuda" and not quick else ("eager", "torch")
    copy = copy_gbps(dev, quick)
    print(f"device {dev}, copy bandwidth {copy:.0f} GB/s, impls {names}", flush=True)
    rows = []
    for w in args.world_sizes:
        for op in args.ops:
            case = build(op, w, sizes, dev, names)
            rows.append(time_case(case, dev, args, deadline))
            print("\n".join(table(rows[-1:], copy)[2:]), flush=True)
            del case
            if dev == "cuda":
                torch.cuda.empty_cache()
    checks = targets(rows, copy)
    guarded = set(args.targets or {c["target"] for c in checks})
    for r in rows:
        mine = [c["pass"] for c in checks if c["target"] in guarded
                and (c["op"], c["world_size"]) == (r["op"], r["world_size"])]  # fmt: skip
        r["targets_met"] = all(mine) if mine else None
    sections = [
        f"Copy bandwidth (read + write): {copy:.0f} GB/s; per-rank load: {sizes.__dict__}.",
        f"Eager: repeated while under {args.eager_budget} s (1 to 5 calls); `eager/fast` divides"
        " by Triton, or by torch where Triton is not run.", "",
        *table(rows, copy), "",
    ]  # fmt: skip
    if checks:
        sections += [
            "## Targets",
            "",
            "| op | W | target | value | pass |",
            "|---|---|---|---|---|",
        ]
        sections += [f"| {c['op']} | {c['world_size']} | {c['target']} | {c['value']} | "
                     f"{'PASS' if c['pass'] else 'MISS'} |" for c in checks]  # fmt: skip
    sections += ["", *dispatch_lines(rows, copy)]
    return Result(rows, sections)
