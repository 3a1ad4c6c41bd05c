"""GPU idle time ("bubbles") in a Chrome trace written by ``torch.profiler``."""

from __future__ import annotations

import bisect
import gzip
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
CPU_CATS = {"cpu_op", "cuda_runtime", "cuda_driver", "python_function", "user_annotation"}
STEP_PREFIX = "ProfilerStep#"
ENGINE_PREFIX = "autograd::engine::evaluate_function"  # ops run by autograd's threads
# Runtime calls during which the host waits for the GPU (a pageable copy syncs too).
WAIT_CALLS = {
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
    "cudaMemcpy", "cudaMemcpyAsync",
}  # fmt: skip
Spans = list[tuple[float, float]]


@dataclass
class Gap:
    start_us: float
    dur_us: float
    cpu: list[str]  # CPU events overlapping the gap, longest overlap first (at most 3)


@dataclass
class GapSizes:
    """The device's idle time split by the length of its gaps: many gaps of a
    few µs are the launch latency between queued kernels (fewer kernels, or
    several streams, remove them); long ones are bubbles (the GPU waited)."""

    below_us: float  # gaps shorter than this (inf: the last bucket)
    count: int
    idle_us: float


# Between two queued kernels a GPU idles ~0.5 µs inside a CUDA graph, ~1-3 µs
# between stream launches; 100 µs is the default listing threshold's order.
GAP_BOUNDS_US = (2.0, 10.0, 100.0, float("inf"))


@dataclass
class StepStats:
    name: str
    window_us: float
    busy_us: float
    idle_us: float
    idle_pct: float


@dataclass
class DeviceSummary:
    device: Any
    start_us: float  # the window is [start_us, start_us + window_us]
    window_us: float
    busy_us: float
    idle_us: float
    idle_pct: float
    comm_us: float  # union of NCCL kernels
    compute_stream: Any
    compute_busy_us: float
    compute_idle_pct: float
    gaps: list[Gap] = field(default_factory=list)
    steps: list[StepStats] = field(default_factory=list)
    gap_sizes: list[GapSizes] = field(default_factory=list)


@dataclass
class HostWait:
    start_us: float
    dur_us: float
    call: str
    inside: list[str]  # enclosing CPU ops of the same thread, innermost last (at most 3)


@dataclass
class HostStep:
    """One profiled step on the host: its span, and the part spent waiting for the GPU."""

    name: str
    window_us: float
    wait_us: float  # in `WAIT_CALLS` on the step's thread
    host_us: float  # window - wait: the host issuing work (or doing its own)


@dataclass
class TraceSummary:
    min_gap_us: float
    window_us: float  # the longest device window; 0 without GPU events
    devices: list[DeviceSummary] = field(default_factory=list)
    host_waits: list[HostWait] = field(default_factory=list)  # >= min_wait_us, in time order


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a ``.json`` or ``.json.gz`` Chrome trace."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such trace file")
    try:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
            trace = json.load(f)
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON Chrome trace ({e})") from None
    if isinstance(trace, list):  # the format also allows a bare event array
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return trace


def _union(spans: Spans) -> Spans:
    out: Spans = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _length(spans: Spans) -> float:
    return sum(e - s for s, e in spans)


def _idle(window: float, busy: float) -> tuple[float, float]:
    return window - busy, 100.0 * (window - busy) / window if window > 0 else 0.0


def _cpu_names(cpu: list, starts: list[float], max_dur: float, lo: float, hi: float) -> list[str]:
    ranked, first = [], bisect.bisect_left(starts, lo - max_dur)
    for s, e, name in cpu[first : bisect.bisect_left(starts, hi)]:
        if e > lo:  # ties go to the shorter event: enclosing Python frames cover every gap
            ranked.append((max(s, lo) - min(e, hi), e - s, name))
    return list(dict.fromkeys(n for *_, n in sorted(ranked)))[:3]


def _device(dev: Any, evs: list, cpu: list, steps: list, min_gap_us: float) -> DeviceSummary:
    busy = _union([(s, e) for s, e, *_ in evs])
    lo, window, busy_us = busy[0][0], busy[-1][1] - busy[0][0], _length(busy)
    streams: dict[Any, Spans] = {}
    work: dict[Any, float] = {}
    for s, e, stream, kernel, nccl in evs:
        if kernel:
            streams.setdefault(stream, []).append((s, e))
            work[stream] = work.get(stream, 0.0) + (0.0 if nccl else e - s)
    # Ranked by non-NCCL time so a long all-reduce stream is never taken for compute.
    compute = max(sorted(work, key=str), key=work.__getitem__, default=None)
    compute_busy = _length(_union(streams[compute])) if compute is not None else 0.0
    starts = [c[0] for c in cpu]
    max_dur = max((e - s for s, e, _ in cpu), default=0.0)
    idle = [b - a for (_, a), (b, _) in itertools.pairwise(busy)]
    gaps = [
        Gap(a, b - a, _cpu_names(cpu, starts, max_dur, a, b))
        for (_, a), (b, _) in itertools.pairwise(busy)
        if b - a >= min_gap_us
    ]
    sizes = [GapSizes(bound, 0, 0.0) for bound in GAP_BOUNDS_US]
    for g in idle:
        size = next(x for x in sizes if g < x.below_us)
        size.count, size.idle_us = size.count + 1, size.idle_us + g
    rows = []
    for s, e, name in steps:
        b = sum(min(be, e) - max(bs, s) for bs, be in busy if be > s and bs < e)
        rows.append(StepStats(name, e - s, b, *_idle(e - s, b)))
    comm = _length(_union([(s, e) for s, e, _, kernel, nccl in evs if kernel and nccl]))
    return DeviceSummary(
        dev, lo, window, busy_us, *_idle(window, busy_us), comm, compute, compute_busy,
        _idle(window, compute_busy)[1], gaps, rows, sizes,
    )  # fmt: skip


def _host_waits(waits: list, ops: list, min_wait_us: float) -> list[HostWait]:
    out = []
    for s, e, tid, call in sorted(waits):
        if e - s >= min_wait_us:
            inside = [n for os_, oe, otid, n in ops if otid == tid and os_ <= s and oe >= e]
            out.append(HostWait(s, e - s, call, inside[-3:]))
    return out


def gpu_gaps(
    trace: dict[str, Any], min_gap_us: float = 50.0, min_wait_us: float = 1000.0
) -> TraceSummary:
    """Busy/idle time of each GPU, its gaps >= ``min_gap_us`` and the CPU work
    during them, and every host wait for the GPU >= ``min_wait_us``."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace (no traceEvents list)")
    gpu: dict[Any, list] = {}
    cpu, steps, waits, ops = [], [], [], []
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X" or "ts" not in ev:
            continue
        cat, name = str(ev.get("cat", "")).lower(), str(ev.get("name", ""))
        args = ev["args"] if isinstance(ev.get("args"), dict) else {}
        s, e = float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))
        if cat in GPU_CATS:
            stream, nccl = args.get("stream", ev.get("tid")), "nccl" in name.lower()
            gpu.setdefault(args.get("device", ev.get("pid")), []).append(
                (s, e, stream, cat == "kernel", nccl)
            )
        elif name.startswith(STEP_PREFIX) and not cat.startswith("gpu_"):
            steps.append((s, e, name))  # the CPU-side step span, not its GPU mirror
        elif cat in CPU_CATS:
            cpu.append((s, e, name))
            if name in WAIT_CALLS:
                waits.append((s, e, ev.get("tid"), name))
            elif cat == "cpu_op":
                ops.append((s, e, ev.get("tid"), name))
    cpu.sort()
    ops.sort()
    steps.sort()
    devices = [_device(d, gpu[d], cpu, steps, min_gap_us) for d in sorted(gpu, key=str)]
    window = max((d.window_us for d in devices), default=0.0)
    return TraceSummary(min_gap_us, window, devices, _host_waits(waits, ops, min_wait_us))


def host_steps(trace: dict[str, Any]) -> list[HostStep]:
    """Per profiled step (CPU ``ProfilerStep#`` span): host time and host waits
    for the GPU on the step's own thread and on autograd's engine threads (the
    step's thread is blocked in backward meanwhile); a loader thread's waits
    block no launch."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace (no traceEvents list)")
    steps, waits, engine = [], [], set()
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X" or "ts" not in ev:
            continue
        cat, name = str(ev.get("cat", "")).lower(), str(ev.get("name", ""))
        s, e = float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))
        if name.startswith(STEP_PREFIX) and not cat.startswith("gpu_"):
            steps.append((s, e, ev.get("tid"), name))
        elif cat in CPU_CATS and name in WAIT_CALLS:
            waits.append((s, e, ev.get("tid")))
        elif name.startswith(ENGINE_PREFIX):
            engine.add(ev.get("tid"))
    out = []
    for s, e, tid, name in sorted(steps, key=lambda x: x[0]):
        blocking = engine | {tid}
        mine = _union([(max(ws, s), min(we, e)) for ws, we, wt in waits if wt in blocking])
        wait = _length([(a, b) for a, b in mine if b > a])
        out.append(HostStep(name, e - s, wait, e - s - wait))
    return out


@dataclass
class ThreadOps:
    """One host thread's top-level ops over the profiled steps, per step."""

    tid: Any
    busy_us: float  # union of its top-level ops (an op nested in another counts once)
    ops: float
    by_name: list[tuple[str, float, float]]  # (name, µs, calls), longest first


def thread_ops(trace: dict[str, Any]) -> list[ThreadOps]:
    """Where each thread's host time goes within the profiled steps: its
    outermost CPU ops by name, per step (the launch thread, and autograd's
    engine thread that runs backward while the launch thread waits)."""
    events = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("ph") == "X"]
    steps = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in events
        if str(e.get("name", "")).startswith(STEP_PREFIX)
        and not str(e.get("cat", "")).lower().startswith("gpu_")
    ]
    if not steps:
        return []
    lo, hi, n = min(a for a, _ in steps), max(b for _, b in steps), len(steps)
    by_tid: dict[Any, list[tuple[float, float, str]]] = {}
    for e in events:
        cat, name = str(e.get("cat", "")).lower(), str(e.get("name", ""))
        if cat in CPU_CATS - {"user_annotation"} and lo <= float(e["ts"]) < hi:
            s = float(e["ts"])
            by_tid.setdefault(e.get("tid"), []).append((s, s + float(e.get("dur", 0.0)), name))
    out = []
    for tid, ops in by_tid.items():
        totals: dict[str, list[float]] = {}
        end = -1.0
        for s, e, name in sorted(ops, key=lambda o: (o[0], -o[1])):
            if s >= end:  # outermost: not inside the previous outermost op
                entry = totals.setdefault(name, [0.0, 0.0])
                entry[0] += e - s
                entry[1] += 1
                end = e
        rows = sorted(((k, us / n, c / n) for k, (us, c) in totals.items()), key=lambda r: -r[1])
        busy = sum(r[1] for r in rows)
        out.append(ThreadOps(tid, busy, sum(r[2] for r in rows), rows))
    return sorted(out, key=lambda t: -t.busy_us)


def format_threads(threads: list[ThreadOps], top: int) -> str:
    lines = []
    for t in threads:
        lines += ["", f"Thread {t.tid}: {_ms(t.busy_us)} ms of outermost ops per step "
                  f"({t.ops:.0f} ops)", ""]  # fmt: skip
        rows = [[_ms(us), f"{c:.1f}", name[:90]] for name, us, c in t.by_name[:top]]
        lines += _table(["ms/step", "calls/step", "op"], rows)
    return "\n".join(lines) + "\n"


def _ms(us: float) -> str:
    return f"{us / 1e3:.3f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return [f"| {' | '.join(r)} |" for r in [head, ["---"] * len(head), *rows]]


def format_summary(summary: TraceSummary) -> str:
    """Markdown: one row per device, then each device's largest gaps and its steps."""
    if not summary.devices:
        return "No GPU events in the trace (CPU-only profile?): GPU window 0 ms.\n"
    head = ["device", "window ms", "busy ms", "idle %", "compute-stream idle %", "NCCL ms", "gaps"]
    rows = [
        [str(d.device), _ms(d.window_us), _ms(d.busy_us), f"{d.idle_pct:.1f}",
         f"{d.compute_idle_pct:.1f} (stream {d.compute_stream})", _ms(d.comm_us), str(len(d.gaps))]
        for d in summary.devices
    ]  # fmt: skip
    lines = _table(head, rows)
    for d in summary.devices:
        if d.gaps:
            lines += ["", f"Device {d.device}: largest gaps (>= {summary.min_gap_us:g} us)", ""]
            top = sorted(d.gaps, key=lambda g: -g.dur_us)[:10]
            rows = [
                [_ms(g.dur_us), _ms(g.start_us - d.start_us), ", ".join(g.cpu) or "-"] for g in top
            ]
            lines += _table(["gap ms", "at ms", "CPU during the gap"], rows)
        if any(x.count for x in d.gap_sizes):
            lines += ["", f"Device {d.device}: idle by gap length", ""]
            lower, rows = 0.0, []
            for x in d.gap_sizes:
                span = f">= {lower:g} us" if x.below_us == float("inf") else f"< {x.below_us:g} us"
                share = 100.0 * x.idle_us / d.window_us if d.window_us else 0.0
                rows.append([span, str(x.count), _ms(x.idle_us), f"{share:.2f}"])
                lower = x.below_us
            lines += _table(["gap", "gaps", "idle ms", "% of window"], rows)
        if d.steps:
            lines += ["", f"Device {d.device}: per step", ""]
            rows = [
                [s.name, _ms(s.window_us), _ms(s.busy_us), f"{s.idle_pct:.1f}"] for s in d.steps
            ]
            lines += _table(["step", "window ms", "busy ms", "idle %"], rows)
    if summary.host_waits:
        start = summary.devices[0].start_us
        title = "Host waits for the GPU (after each the GPU idles until new work is queued)"
        lines += ["", title, ""]
        rows = [
            [_ms(w.dur_us), _ms(w.start_us - start), w.call, " > ".join(w.inside) or "-"]
            for w in summary.host_waits
        ]
        lines += _table(["wait ms", "at ms", "call", "inside"], rows)
    return "\n".join(lines) + "\n"
