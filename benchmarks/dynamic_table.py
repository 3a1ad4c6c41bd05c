"""Dynamic tables beside a static table of the same rows: lookups and updates per
second, peak memory, and the memory-flat check.

Every case trains one table at one rank (``Sync`` mode, a fixed gradient) on
the same steps: ``ids_per_step`` Zipf(``alpha``) draws over ``universe`` rows,
the same optimizer, dim and dtype. The static table looks the draws up as row
numbers; a dynamic one looks up their 64-bit mixes (`mix64`, a bijection: the
same rows in the same pattern, as raw hashes). ``capacity`` is a share of the
universe: 1.0 holds every id (nothing evicted), below it the table evicts every
step. Cases alternate over ``reps`` runs; each number is the median.

- ``lookups_per_s`` / ``updates_per_s``: ids per second through the forward
  (preflight, the dynamic map, gather) / the backward (duplicate sum, optimizer);
  ``map_ms``: the ``ids_a2a`` timer section, which at one rank is the
  dynamic id -> slot map alone (`ShardStore.receive`).
- ``cpu_ms``: the process's CPU time per step (all threads): with one thread,
  what a step costs without the waits for a core on a loaded machine.
- ``peak_mb``: the most memory the case held above what the process held before
  its table was built, measured apart: one run of each case in a child process
  under ``MEMORY_ENV`` (`in_child`). CPU: the RSS high-water mark (``VmHWM``,
  reset through ``/proc/self/clear_refs``) minus the RSS then; torch's CPU
  tensors are malloc'ed and written, so they are resident, and under
  ``MEMORY_ENV`` freed ones leave. CUDA: ``max_memory_allocated``.
- Flat (``params.flat``, in such a child too): ``passes`` x
  ``capacity`` distinct ids streamed through a dynamic table of ``capacity`` rows
  (``new_per_step`` fresh ids a step beside draws from ``hot`` recurring ones);
  ``flat_ok`` when no later pass peaks above ``flat_ratio`` x the first pass's
  peak (the table filling) + ``slack_mb``, and the table's tensors hold the same
  bytes after the last pass as after the first.
- ``cpu_threads``: torch's intra-op threads (0: torch's default). On a small
  shared machine set 1: every parallel op then stops waiting for a core other
  jobs hold (2 threads on 2 loaded cores: steps up to 10x slower, measured).

    python -m benchmarks run dynamic-table          # device: params.device (auto: cuda if present)
    python -m benchmarks run dynamic-table --smoke  # seconds, CPU
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from freescale.comm.fake import FakeCommunicator, FakeWorld
from freescale.embedding import ShardedEmbeddingCollection, ShardingPlan, TableConfig
from freescale.embedding.dynamic import DynamicSpec, mix64

from .embedding import DTYPES, OPTIMIZERS, PhaseTimer, sync, zipf_ids
from .report import table
from .runner import Ctx, Result
from .scenario import Scenario

DEFAULTS = {"device": "auto", "cpu_threads": 0, "universe": 1_000_000, "ids_per_step": 65536,
            "dim": 64, "dtype": "fp32", "optimizer": "adagrad", "alpha": 1.05, "warmup": 40,
            "steps": 10, "reps": 3, "cases": [["static", 1.0, "", 1], ["dynamic", 1.0, "lru", 1]],
            "flat": {"capacity": 100_000, "passes": 10, "new_per_step": 10_000, "hot": 2_000,
                     "flat_ratio": 1.05, "slack_mb": 1.0}}  # fmt: skip
COLUMNS = ["case", "slots", "unique_per_step", "step_ms", "cpu_ms", "fwd_ms", "bwd_ms", "map_ms",
           "update_ms", "lookups_per_s", "updates_per_s", "step_vs_static", "occupancy_pct",
           "inserts_per_step", "evictions_per_step", "not_admitted_per_step", "held_mb",
           "peak_mb"]  # fmt: skip
FLAT_COLUMNS = ["distinct_ids", "capacity", "steps", "evictions", "held_mb_first_pass",
                "held_mb_last_pass", "peak_mb_first_pass", "peak_mb_last_pass", "peak_mb_passes",
                "flat_ok"]  # fmt: skip
# glibc: every allocation of 128 KiB or more mapped, and unmapped when freed (no
# dynamic threshold), so a memory run's RSS is its live memory, not free heap pages
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
ROOT = Path(__file__).resolve().parent.parent
STATUS = Path("/proc/self/status")


# ---- memory ------------------------------------------------------------------------
class Memory:
    """Peak memory of a window above a base: CPU RSS high-water mark, or CUDA allocations."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        gc.collect()
        self.base = self.now()

    def now(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _status_kb("VmRSS") * 1024

    def window(self) -> None:
        """Start a window: its peak counts from here."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _status_kb("VmHWM") * 1024
        return (peak - self.base) / 2**20


def _status_kb(key: str) -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise ValueError(f"{STATUS} has no {key}")


def held_mb(coll: ShardedEmbeddingCollection) -> float:
    """Bytes the collection's tensors hold: rows, optimizer state and a dynamic map."""
    tensors = list(coll.buffers())
    for store in coll.stores:
        if store.dynamic is not None:
            tensors += [*store.dynamic.map.tensors().values(), *store.dynamic.map.held()]
    return sum(t.numel() * t.element_size() for t in tensors) / 2**20


# ---- one case ----------------------------------------------------------------------
def build(args, comm, device: torch.device, dynamic: DynamicSpec | None):
    table = TableConfig("t", args.universe, args.dim, DTYPES[args.dtype], dynamic=dynamic)
    plan = ShardingPlan(optimizer=OPTIMIZERS[args.optimizer][0]())
    timer = PhaseTimer(device)
    return ShardedEmbeddingCollection([table], comm, plan, device, timer=timer), timer


def zipf_steps(args, device: torch.device) -> list[torch.Tensor]:
    """The row numbers of every step (warm-up first), the same for every case."""
    gen = torch.Generator(device=device).manual_seed(17)
    n, steps = args.ids_per_step, args.warmup + args.steps
    return [zipf_ids(n, args.universe, args.alpha, gen, device) for _ in range(steps)]


def train_step(coll, ids: torch.Tensor, grad: torch.Tensor, device) -> tuple[float, ...]:
    """(forward s, backward s, the process's CPU s) of one step."""
    sync(device)
    cpu, start = time.process_time(), time.perf_counter()
    out = coll({"t": ids})["t"]
    sync(device)
    mid = time.perf_counter()
    out.backward(grad[: ids.numel()])
    sync(device)
    return mid - start, time.perf_counter() - mid, time.process_time() - cpu


def run_case(args, comm, device: torch.device, case: list, steps: list[torch.Tensor]) -> dict:
    """One table trained over ``steps`` (row numbers); its timed steps' rates and memory."""
    kind, share, evict, admit_after = case
    capacity = max(1, round(share * args.universe))
    spec = DynamicSpec(capacity, evict, int(admit_after)) if kind == "dynamic" else None
    grad = torch.randn(args.ids_per_step, args.dim, device=device).to(DTYPES[args.dtype])
    mem = Memory(device)
    mem.window()
    coll, timer = build(args, comm, device, spec)
    times, counts = [], []
    for i, rows in enumerate(steps):
        if i == args.warmup:
            timer.times.clear()
            coll.dynamic_counts()  # counts restart: the timed steps' alone
        times.append(train_step(coll, mix64(rows) if spec else rows, grad, device))
    fwd, bwd, cpu = (sum(t[i] for t in times[args.warmup :]) / args.steps for i in range(3))
    counts = coll.dynamic_counts() or (args.universe, args.universe, 0, 0, 0, 0)
    held, slots, inserts, evictions, not_admitted, dropped = counts
    uniq = statistics.mean(torch.unique(r).numel() for r in steps[args.warmup :])
    phase = {k: sum(v) / len(v) * 1e3 for k, v in timer.times.items() if v}
    admitted = f" admit {admit_after}" if admit_after > 1 else ""
    row = {
        "case": "static" if not spec else f"dynamic {evict} {share:.0%}" + admitted,
        "table": kind, "capacity": capacity if spec else None, "evict": evict or None,
        "admit_after": int(admit_after) if spec else None, "slots": slots,
        "ids_per_step": args.ids_per_step, "unique_per_step": uniq,
        "step_ms": (fwd + bwd) * 1e3, "cpu_ms": cpu * 1e3, "fwd_ms": fwd * 1e3, "bwd_ms": bwd * 1e3,
        "map_ms": phase.get("ids_a2a", 0.0), "update_ms": phase.get("update", 0.0),
        "lookups_per_s": args.ids_per_step / fwd, "updates_per_s": args.ids_per_step / bwd,
        "occupancy_pct": 100.0 * held / slots, "inserts_per_step": inserts / args.steps,
        "evictions_per_step": evictions / args.steps, "not_admitted_per_step":
        not_admitted / args.steps, "dropped_per_step": dropped / args.steps,
        "held_mb": held_mb(coll), "peak_mb": mem.peak_mb(),
    }  # fmt: skip
    del coll, timer
    return row


def flat_steps(f: SimpleNamespace, device: torch.device) -> list[torch.Tensor]:
    """``passes`` x ``capacity`` distinct ids in all: each step ``new_per_step`` ids
    never seen before beside ``new_per_step`` draws from ``hot`` recurring ones."""
    steps = math.ceil(f.passes * f.capacity / f.new_per_step)
    gen = torch.Generator(device=device).manual_seed(23)
    out = []
    for s in range(steps):
        fresh = f.hot + s * f.new_per_step + torch.arange(f.new_per_step, device=device)
        hot = torch.randint(0, f.hot, (f.new_per_step,), generator=gen, device=device)
        out.append(mix64(torch.cat([hot, fresh])))
    return out


def run_flat(args, comm, device: torch.device) -> dict:
    """Peak memory of the first pass over ``capacity`` new ids vs the last pass."""
    f = SimpleNamespace(**args.flat)
    steps = flat_steps(f, device)
    per_pass = math.ceil(len(steps) / f.passes)
    grad = torch.randn(2 * f.new_per_step, args.dim, device=device).to(DTYPES[args.dtype])
    mem = Memory(device)
    coll, _ = build(args, comm, device, DynamicSpec(f.capacity))
    peaks, held, evictions = [], [], 0
    for p in range(f.passes):
        mem.window()
        for ids in steps[p * per_pass : (p + 1) * per_pass]:
            train_step(coll, ids, grad, device)
        peaks.append(mem.peak_mb())
        held.append(held_mb(coll))
        evictions += coll.dynamic_counts()[3]
    distinct = torch.unique(torch.cat(steps)).numel()
    flat = max(peaks[1:]) <= f.flat_ratio * peaks[0] + f.slack_mb and held[-1] == held[0]
    row = {"case": f"flat: {distinct} ids through {f.capacity} rows", "table": "dynamic",
           "capacity": f.capacity, "evict": "lru", "slots": f.capacity, "distinct_ids": distinct,
           "steps": len(steps), "evictions": evictions, "held_mb_first_pass": held[0],
           "held_mb_last_pass": held[-1], "peak_mb_first_pass": peaks[0],
           "peak_mb_last_pass": peaks[-1], "peak_mb_passes": [round(p, 1) for p in peaks],
           "flat_ok": flat}  # fmt: skip
    del coll
    return row


# ---- the scenario ------------------------------------------------------------------
def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Per case, every number as the median over the reps."""
    out = []
    for reps in zip(*runs, strict=True):
        row = dict(reps[0])
        for k, v in row.items():
            if isinstance(v, float):
                row[k] = statistics.median(r[k] for r in reps)
        out.append(row)
    return out


def measure(s: Scenario, ctx: Ctx) -> Result:
    args = SimpleNamespace(**{**DEFAULTS, **s.params})
    args.flat = {**DEFAULTS["flat"], **args.flat}
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cpu" if ctx.smoke else auto if args.device == "auto" else args.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.cpu_threads or threads)
    try:
        rows = run_cases(args, device)
        for row, peak in zip(rows, in_child("peaks", args, device), strict=True):
            row["peak_mb"] = peak
        flat = in_child("flat", args, device)
        sections = [*table(rows, COLUMNS), "", *notes(args, device), "", "## Memory flat", "",
                    *table([flat], FLAT_COLUMNS)]  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return Result([*rows, flat], sections)


def in_child(what: str, args, device: torch.device) -> Any:
    """`child` in a fresh process under ``MEMORY_ENV``: in this one the heap's free
    but resident pages moved the flat run's pass peaks between 100 and 125 MB (one
    table; 69 MB within 0.5 MB under it), which would hide a map that grew."""
    spec = json.dumps({**vars(args), "device": device.type})
    cmd = [sys.executable, "-m", "benchmarks.dynamic_table", what, spec]
    env = {**os.environ, **MEMORY_ENV}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"the {what} run failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def child(what: str, args, device: torch.device) -> Any:
    """``flat``: `run_flat`'s row; ``peaks``: each case's peak_mb, one run of each."""
    comm = FakeCommunicator(FakeWorld(1), 0, device)
    if what == "flat":
        return run_flat(args, comm, device)
    steps = zipf_steps(args, device)
    return [run_case(args, comm, device, c, steps)["peak_mb"] for c in args.cases]


def run_cases(args, device: torch.device) -> list[dict]:
    """Every case ``reps`` times, alternating the order (load on a shared machine
    then hits every case alike); medians, and each case's step time over the static's."""
    comm = FakeCommunicator(FakeWorld(1), 0, device)
    steps = zipf_steps(args, device)
    runs = []
    for rep in range(args.reps):
        order = args.cases if rep % 2 == 0 else args.cases[::-1]
        done = {id(c): run_case(args, comm, device, c, steps) for c in order}
        runs.append([done[id(c)] for c in args.cases])
    rows = median_rows(runs)
    static = next((r for r in rows if r["table"] == "static"), None)
    for r in rows:
        r["step_vs_static"] = r["step_ms"] / static["step_ms"] if static else None
    return rows


def notes(args, device: torch.device) -> list[str]:
    peak = ("CUDA max_memory_allocated above the allocations before the table"
            if device.type == "cuda" else "RSS high-water mark (VmHWM, reset per window"
            " through /proc/self/clear_refs) above the RSS before the table")  # fmt: skip
    return [
        f"Device {device}; one rank; {args.ids_per_step} ids a step, Zipf alpha {args.alpha} over"
        f" {args.universe} rows (dynamic tables: their 64-bit mixes); dim {args.dim},"
        f" {args.dtype}, {args.optimizer}; {args.warmup} warm-up + {args.steps} timed steps,"
        f" median of {args.reps} alternating runs; {os.cpu_count()} CPUs, torch intra-op threads"
        f" {torch.get_num_threads()}, load average at the end {os.getloadavg()[0]:.1f}.",
        "",
        f"Peak memory: {peak}, one run of each case in a child process with"
        f" {' '.join(f'{k}={v}' for k, v in MEMORY_ENV.items())} (its RSS is the live memory,"
        " not the heap's free pages), as the flat run; held_mb: the bytes of the table's"
        " tensors (rows, optimizer state, map).",
        "map_ms: the ids_a2a timer section, at one rank the dynamic id -> slot map alone.",
    ]


if __name__ == "__main__":  # `in_child`
    spec = SimpleNamespace(**json.loads(sys.argv[2]))
    dev = torch.device(spec.device)
    torch.set_num_threads(spec.cpu_threads or torch.get_num_threads())
    print(json.dumps(child(sys.argv[1], spec, dev)))
