"""Training scenarios: one `freescale train` run per grid point, through public hooks.

Every point is ``build_config(preset, overrides)`` + ``launch(cfg)`` with the
overrides written through ``scenarios/keys.toml`` (``scenario.setting``); the
numbers come from what a run publishes: its summary (means over post-warm-up
steps: step time, QPS, straggler %, compute, exposed communication per
category, data wait, collision rates, NE), its per-step metrics JSON lines,
and, when ``trace_steps`` is given, its profiler trace (rank 0's GPU idle %
and host ms per step, `freescale.observe.trace`; GPU ms and launches per
step of each kernel class, ``ms_<class>`` / ``launches_<class>``,
`freescale.observe.kernel_classes`). At world size 1 the run
happens in this process (``in_process``), so peak GPU memory can be read.
Model FLOPs per step, TFLOP/s per GPU and MFU are the trainer's own (its
summary's ``step_tflop``, ``tflops``, ``mfu_pct``: null where the model counts
no FLOPs or, for MFU, the device's peak is unknown; ``peak_tflops`` overrides it).

File data adds test HR@10 / NDCG@10 and the popularity baseline's
(``test_hr@10``, ``popularity_test_ndcg@10``, ...) and ``best_epoch``
(``evaluation.keep_best``). ``preset`` may be a [grid] axis (recipes).
Parameters (``[params]``): ``preset``, ``steps``, ``warmup``, ``trace_steps``
("30-32"), ``loss_gap`` (true: the largest per-step loss gap of each point to the
``mode = "sync"`` point of the same other axes, from the step logs).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import socket
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from freescale.config import build_config, trace_window
from freescale.observe.timing import CATEGORIES
from freescale.run.launch import launch

from .runner import Ctx, Result
from .scenario import Scenario, setting

SUMMARY_KEYS = ("step_ms", "compute_ms_mean", "qps", "straggler_pct", "data_wait_ms",
                "data_wait_ms_max", "exposed_collision_ms", "collision_rows_pct",
                "collision_ids_pct", "ne", "train_ne_last", "measured_steps", "step_tflop",
                "tflops", "mfu_pct", "peak_tflops", "compiled_frames_after_warmup",
                "attention_graphs_after_warmup",
                "host_tier_bytes", "host_tier_exposed_ms", "host_tier_gb_s")  # fmt: skip


def points(s: Scenario) -> list[dict[str, Any]]:
    """Grid points: world size (``nproc``) x the [grid] axes, in file order."""
    axes = {"nproc": s.ranks, **s.grid}
    return [dict(zip(axes, p, strict=True)) for p in itertools.product(*axes.values())]


@contextmanager
def single_rank() -> Any:
    """This process as rank 0 of a world of one (the environment torchrun gives),
    so the run happens here and its peak GPU memory is readable."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}  # fmt: skip
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def overrides(s: Scenario, point: dict[str, Any], metrics: Path, trace: Path | None) -> list[str]:
    p = s.params
    sets = [setting(k, v) for k, v in s.set.items()]
    sets += [setting(k, v) for k, v in point.items() if k != "preset"]  # preset: an axis too
    sets += [setting("steps", p.get("steps", 60)), setting("warmup", p.get("warmup", 10)),
             setting("progress", False), setting("metrics_path", metrics)]  # fmt: skip
    if "eval_every" not in s.set:
        sets.append(setting("eval_every", 0))
    if trace is not None:
        sets += [setting("trace_path", trace), setting("trace_steps", p["trace_steps"])]
    return sets


def run_point(s: Scenario, point: dict[str, Any], raw: Path) -> dict[str, Any]:
    slug = "-".join(f"{k}{v}" for k, v in point.items())
    metrics = raw / f"{slug}.jsonl"
    trace = raw / f"{slug}-trace.json.gz" if s.params.get("trace_steps") else None
    preset = point.get("preset", s.params.get("preset", "demo"))
    cfg = build_config(preset, overrides(s, point, metrics, trace))
    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    local = point["nproc"] == 1 and s.params.get("in_process", True)
    gc.collect()
    if cuda and local:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if local:
        with single_rank():
            summary = launch(cfg)
    else:
        summary = launch(cfg)
    assert summary is not None
    row: dict[str, Any] = {**point, "point": point, "point_s": time.perf_counter() - start}
    row.update({k: summary.get(k) for k in SUMMARY_KEYS})
    # dense.compile's word (on, or why not: under graphs that ran); the axis keeps its value
    row["compile_ran"] = summary.get("dense_compile", "off")
    if row.get("host_tier_bytes") is not None:  # host-tier runs: GB moved per step
        row["host_tier_gb_step"] = row["host_tier_bytes"] / 1e9
    for c in CATEGORIES:
        row[f"exposed_{c}_ms"] = summary["exposed_comm_ms"][c]
    row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9 if cuda and local else None
    final = summary.get("eval", {})  # file data: test metrics, popularity, keep_best's pick
    for split, k in itertools.product(("test", "popularity_test"), ("hr@10", "ndcg@10")):
        row[f"{split}_{k}"] = final.get(split, {}).get(k)
    row["best_epoch"], row["wall_s"] = final.get("best", {}).get("epoch"), summary.get("wall_s")
    if trace is not None:
        row.update(trace_numbers(trace, s.params["trace_steps"]))
        if row.get("gpu_idle_pct") is not None:  # untraced steps' mean, as overhead.py did
            first, last = trace_window(s.params["trace_steps"])
            steps = _steps(metrics)
            warm = cfg.run.warmup
            kept = [x for x in steps if x["step"] >= warm and not first <= x["step"] <= last]
            row["step_ms"] = statistics.mean(x["step_ms"] for x in kept) if kept else row["step_ms"]
            traced = [x["step_ms"] for x in steps if first <= x["step"] <= last]
            row["traced_step_ms"] = statistics.mean(traced) if traced else None
    row["steps_file"] = metrics.name
    return row


def _steps(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def trace_numbers(path: Path, steps: str) -> dict[str, Any]:
    """Rank 0's GPU idle % over the traced steps, host ms per traced step and
    GPU ms / launches per traced step of each kernel class (summed over streams)."""
    from freescale.observe.kernel_classes import CLASSES, kernel_times
    from freescale.observe.trace import gpu_gaps, host_steps, load_trace

    if not path.exists():
        return {"gpu_idle_pct": None, "host_ms": None}
    trace = load_trace(path)
    devices, hosts = gpu_gaps(trace).devices, host_steps(trace)
    row = {
        "gpu_idle_pct": devices[0].idle_pct if devices else None,
        "host_ms": statistics.mean(h.host_us for h in hosts) / 1e3 if hosts else None,
        "host_wait_ms": statistics.mean(h.wait_us for h in hosts) / 1e3 if hosts else None,
    }
    times = kernel_times(trace)
    for cls, t in times.items():  # all 0 on a CPU-only trace
        row[f"ms_{cls}"], row[f"launches_{cls}"] = round(t.ms, 4), round(t.launches, 2)
    # The old per-class columns' sum: each stream's kernels counted in full.
    row["ms_stream_sum"] = round(times["busy"].stream_ms, 4)
    if devices:  # the trace module's own union, per traced step: the classes must add up to it
        n = max(1, len(hosts))
        row["gpu_busy_ms"] = devices[0].busy_us / 1e3 / n
        row["gpu_window_ms"] = devices[0].window_us / 1e3 / n
        parts = sum(times[c].ms for c in CLASSES)
        row["classes_add_up"] = abs(parts - row["gpu_busy_ms"]) <= 0.05 * row["gpu_busy_ms"]
    return row


def loss_gaps(rows: list[dict[str, Any]], raw: Path) -> None:
    """``loss_gap_max``: per point, the largest per-step |loss - sync's loss|."""
    losses = {r["steps_file"]: [x["loss"] for x in _steps(raw / r["steps_file"])] for r in rows}
    for r in rows:
        others = {k: v for k, v in r["point"].items() if k != "mode"}
        ref = [b for b in rows if b.get("mode") == "sync" and
               all(b["point"].get(k) == v for k, v in others.items())]  # fmt: skip
        if ref:
            a, b = losses[r["steps_file"]], losses[ref[0]["steps_file"]]
            r["loss_gap_max"] = max((abs(x - y) for x, y in zip(a, b, strict=False)), default=0.0)


def plot(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """Straggler % and QPS against world size, one line per other point."""
    if len({r["nproc"] for r in rows}) < 2:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install .[bench]): no plot", file=sys.stderr)
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[str, list[dict]] = {}
    for r in rows:
        label = " ".join(f"{k}={v}" for k, v in r["point"].items() if k != "nproc")
        series.setdefault(label, []).append(r)
    for label, pts in sorted(series.items()):
        x = [r["nproc"] for r in pts]
        axes[0].plot(x, [r["straggler_pct"] for r in pts], marker="o", label=label)
        axes[1].plot(x, [r["qps"] / 1e6 for r in pts], marker="o", label=label)
    for ax, ylabel in zip(axes, ("straggler %", "QPS (M items/s)"), strict=True):
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize="small")
    fig.tight_layout()
    path = out.with_suffix(".png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def measure(s: Scenario, ctx: Ctx) -> Result:
    rows = []
    grid = points(s)
    for k, point in enumerate(grid, 1):
        rows.append(run_point(s, point, ctx.raw))
        shown = {m: rows[-1].get(m) for m in s.metrics}
        print(f"[{k}/{len(grid)}] {point} {json.dumps(shown, default=str)}", flush=True)
    if s.params.get("loss_gap"):
        loss_gaps(rows, ctx.raw)
    sections = [
        "Means over post-warm-up steps (`freescale train`'s summary); exposed "
        "communication per step, mean over ranks; raw step logs are not committed."
    ]
    return Result(rows, sections, plot(rows, ctx.out))
