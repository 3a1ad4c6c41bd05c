"""Host overhead on one GPU: is the host ever the bottleneck? (world size 1)

For each point (max UIH x batch x mode) one training run, in this process,
records: step time (mean of the measured, untraced steps), host time per step
and host waits for the GPU (profiled steps, `freescale.pipeline.trace.host_steps`),
GPU idle % over the profiled steps (`freescale trace`'s number), and peak GPU
memory (`torch.cuda.max_memory_allocated`) with its ratio to `sync` at the same
point (the paper budgets one extra batch of inputs for prefetching, §6.1:
target <= 1.10). Host figures come from profiled steps, so they include the
profiler's own per-op cost (an upper bound).

Prints a table, writes markdown + JSON, ends with one JSON line. With
``--baseline FILE`` (a JSON written by an earlier run) it exits 1 when a
point's GPU idle % exceeds its recorded value by more than ``--tolerance``
points (2 by default). To record a baseline, copy a run's JSON to
``benchmarks/results/overhead-baseline.json`` (the `overhead` part of
`gpu_session.sh` checks against it when it exists).

    python benchmarks/overhead.py                      # 3 UIH x 2 batches x 3 modes, 1 GPU
    python benchmarks/overhead.py --baseline benchmarks/results/overhead-baseline.json
    python benchmarks/overhead.py --batch 32 --max-uih 2000 --repeat 3  # median of 3 runs
    python benchmarks/overhead.py --smoke              # seconds, on CPU (no idle %, no memory)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import date
from pathlib import Path
from typing import Any

import torch

from freescale.pipeline.config import build_config, trace_window
from freescale.pipeline.launch import launch
from freescale.pipeline.trace import gpu_gaps, host_steps, load_trace

SMOKE = {"preset": "demo", "max_uih": "48", "batch": "4", "modes": "sync,sdd"}
SMOKE_OUT = Path(tempfile.gettempdir()) / "freescale-overhead-smoke"  # not a result
SMOKE_SET = ["device=cpu", "num_items=500", "layers=1", "loader_workers=0"]
KEY = ("max_uih", "batch_size", "mode")
POINT_TAG = "overhead-point: "


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="h200-21k")
    p.add_argument("--max-uih", default="2000,8000,21000")
    p.add_argument("--batch", default="32,128")
    p.add_argument("--modes", default="sync,sdd,freescale")
    # 40 steps: graph captures (dense_graphs=true) and the loader's start are over by 20.
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--trace-steps", default="30-32", help="profiled steps (inclusive)")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--baseline", default="", help="JSON of an earlier run: fail on idle % rises")
    p.add_argument("--tolerance", type=float, default=2.0, help="allowed idle rise (points)")
    # At UIH 2k batch 32 one run's idle swings by 3-5 points with the host's speed.
    p.add_argument("--repeat", type=int, default=1,
                   help="runs per point; the row is the run of median GPU idle")  # fmt: skip
    p.add_argument("--smoke", action="store_true", help="tiny CPU run (checks the plumbing)")
    p.add_argument("--out", default=f"benchmarks/results/overhead-{date.today()}")
    p.add_argument("--point", default="", help=argparse.SUPPRESS)  # one run, in a child
    if p.parse_known_args(argv)[0].smoke:  # smaller defaults; explicit options still win
        p.set_defaults(**SMOKE, steps=5, warmup=1, trace_steps="2-3", out=str(SMOKE_OUT))
    args = p.parse_args(argv)
    if args.smoke:
        args.overrides = [*SMOKE_SET, *args.overrides]
    return args


@contextmanager
def single_rank() -> Any:
    """This process as rank 0 of a world of one, as under torchrun: the run happens
    here, so its peak GPU memory can be read (a fresh port each run)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(port)
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


def spawn_point(args: argparse.Namespace, settings: dict[str, Any]) -> dict[str, Any]:
    """One point in a fresh process: its peak memory is its own, and nothing a run
    leaves allocated can pile up over the grid."""
    cmd = [
        sys.executable, __file__, "--preset", args.preset, "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--trace-steps", args.trace_steps, "--out", args.out,
        *(f"--set={o}" for o in args.overrides), "--point", json.dumps(settings),
    ]  # fmt: skip
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    rows = [x for x in done.stdout.splitlines() if x.startswith(POINT_TAG)]
    if done.returncode != 0 or not rows:
        raise RuntimeError(f"point {settings} failed (rc {done.returncode}); its stderr is above")
    return json.loads(rows[-1][len(POINT_TAG) :])


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median GPU idle (the lower middle of an even count), with every
    run's idle in ``gpu_idle_pct_runs``; runs without one (CPU) keep the first.
    The step files left are the last run's."""
    measured = sorted((r for r in runs if r["gpu_idle_pct"] is not None),
                      key=lambda r: r["gpu_idle_pct"])  # fmt: skip
    row = dict(measured[(len(measured) - 1) // 2] if measured else runs[0])
    row["gpu_idle_pct_runs"] = [r["gpu_idle_pct"] for r in runs]
    return row


def _flat_keys(key: str, path: str) -> None:
    """This script's grid still names the flat keys (aliases of section.key): no notice."""


def run_point(args: argparse.Namespace, settings: dict[str, Any], raw: Path) -> dict[str, Any]:
    slug = "-".join(f"{k}{v}" for k, v in settings.items())
    metrics, trace = raw / f"{slug}.jsonl", raw / f"{slug}-trace.json.gz"
    cfg = build_config(args.preset, [
        *args.overrides, "nproc=1", f"steps={args.steps}", f"warmup={args.warmup}",
        "progress=false", "eval_every=0", f"metrics_path={metrics}", f"trace_path={trace}",
        f"trace_steps={args.trace_steps}", *(f"{k}={v}" for k, v in settings.items()),
    ], on_deprecated=_flat_keys)  # fmt: skip
    device = cfg.run.device
    cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start_bytes = torch.cuda.memory_allocated() if cuda else 0
    t0 = time.perf_counter()
    with single_rank():
        summary = launch(cfg)
    assert summary is not None
    row: dict[str, Any] = {**settings, "point_s": time.perf_counter() - t0}
    if "dense_graphs_captured" in summary:  # dense_graphs=true: graphs captured in the run
        row["graphs_captured"] = summary["dense_graphs_captured"]
    row["peak_mem_gb"] = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    row["mem_left_gb"] = (torch.cuda.memory_allocated() - start_bytes) / 1e9 if cuda else None
    first, last = trace_window(args.trace_steps)
    steps = [json.loads(x) for x in metrics.read_text().splitlines()]
    untraced = [s for s in steps if s["step"] >= args.warmup and not first <= s["step"] <= last]
    row["step_ms"] = statistics.mean(s["step_ms"] for s in untraced or steps)
    row["data_wait_ms"] = statistics.mean(s["data_wait_ms"] for s in untraced or steps)
    row.update(trace_numbers(trace))
    return row


def trace_numbers(path: Path) -> dict[str, Any]:
    """GPU idle % (device 0, as `freescale trace`) and host ms per profiled step."""
    if not path.exists():
        return {"gpu_idle_pct": None, "host_ms": None, "host_wait_ms": None, "traced_steps": 0}
    trace = load_trace(path)
    devices = gpu_gaps(trace).devices
    hosts = host_steps(trace)
    dev = devices[0] if devices else None

    def mean_ms(field: str) -> float | None:
        return statistics.mean(getattr(h, field) for h in hosts) / 1e3 if hosts else None

    gaps = sorted(dev.gaps, key=lambda g: -g.dur_us)[:5] if dev else []
    return {
        "gpu_idle_pct": dev.idle_pct if dev else None,
        "traced_ms": mean_ms("window_us"),
        "host_ms": mean_ms("host_us"),
        "host_wait_ms": mean_ms("wait_us"),
        "traced_steps": len(hosts),
        "top_gaps": [{"ms": g.dur_us / 1e3, "cpu": g.cpu} for g in gaps],
    }


def add_memory_ratios(rows: list[dict[str, Any]]) -> None:
    sync = {(r["max_uih"], r["batch_size"]): r["peak_mem_gb"] for r in rows if r["mode"] == "sync"}
    for r in rows:
        base = sync.get((r["max_uih"], r["batch_size"]))
        ok = base and r["peak_mem_gb"] is not None
        r["mem_vs_sync"] = r["peak_mem_gb"] / base if ok else None


def read_baseline(path: str, overrides: list[str] | None = None) -> dict[tuple, float]:
    """Idle % per (max UIH, batch, mode) from a JSON this script wrote (file or JSON line).

    A baseline recorded with other ``--set`` overrides (``dense_graphs=true``,
    say) measures another program: comparing with it is an error."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"--baseline {path}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError:  # a log: its last JSON line
        lines = [x for x in text.splitlines() if x.strip().startswith("{")]
        try:
            data = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            data = None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"--baseline {path}: not a JSON with 'rows' from overhead.py")
    recorded, wanted = sorted(data.get("overrides", [])), sorted(overrides or [])
    if recorded != wanted:
        raise ValueError(
            f"--baseline {path} was recorded with --set {recorded or 'nothing'}, "
            f"this run has {wanted or 'nothing'}: compare like with like"
        )
    return {
        tuple(r[k] for k in KEY): r["gpu_idle_pct"]
        for r in data["rows"]
        if r.get("gpu_idle_pct") is not None
    }


def check_baseline(rows: list[dict[str, Any]], base: dict[tuple, float], tol: float) -> list[str]:
    failures = []
    for r in rows:
        was = base.get(tuple(r[k] for k in KEY))
        r["baseline_idle_pct"] = was
        if was is None or r["gpu_idle_pct"] is None:
            continue
        if r["gpu_idle_pct"] > was + tol:
            failures.append(
                f"UIH {r['max_uih']} batch {r['batch_size']} {r['mode']}: GPU idle "
                f"{r['gpu_idle_pct']:.2f}% > recorded {was:.2f}% + {tol:g}"
            )
    return failures


def _f(x: Any, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = (
        "| max UIH | batch | mode | step ms | host ms/step | host wait ms/step | GPU idle % "
        "| recorded idle % | peak GPU GB | mem vs sync | data wait ms |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['max_uih']} | {r['batch_size']} | {r['mode']} | {r['step_ms']:.2f} | "
            f"{_f(r['host_ms'], '.2f')} | {_f(r['host_wait_ms'], '.2f')} | "
            f"{_f(r['gpu_idle_pct'], '.2f')} | {_f(r.get('baseline_idle_pct'), '.2f')} | "
            f"{_f(r['peak_mem_gb'], '.2f')} | {_f(r['mem_vs_sync'], '.3f')} | "
            f"{r['data_wait_ms']:.2f} |"
        )
    return lines


def write(args: argparse.Namespace, rows: list[dict[str, Any]], failures: list[str]) -> None:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    meta = {
        "title": "Host overhead at world size 1",
        "date": str(date.today()),
        "machine": f"{torch.cuda.device_count()} x {gpu}, torch {torch.__version__}",
        "command": f"python {' '.join(sys.argv)}",
        "overrides": args.overrides,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [
        f"# {meta['title']}", "",
        f"- date: {meta['date']}", f"- machine: {meta['machine']}",
        f"- command: `{meta['command']}`", "",
        f"Step ms: mean of post-warm-up steps outside the profiled ones ({args.trace_steps}). "
        "Host ms/step: profiled step span minus host waits for the GPU on the step's "
        "thread (includes the profiler's cost). GPU idle %: device 0 over the profiled "
        "steps, as `freescale trace`. Peak GPU: `torch.cuda.max_memory_allocated`; target "
        "mem vs sync <= 1.10. Targets: GPU idle <= 3% everywhere.", "",
        *table(rows),
    ]  # fmt: skip
    if failures:
        lines += ["", "## Regressions (GPU idle above the recorded value)", ""]
        lines += [f"- {f}" for f in failures]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        if args.repeat < 1:
            raise ValueError(f"--repeat must be >= 1, got {args.repeat}")
        first, last = trace_window(args.trace_steps)
        if not args.warmup <= first <= last < args.steps:
            raise ValueError(f"--trace-steps must lie in [warmup, steps) = [{args.warmup}, "
                             f"{args.steps}), got {args.trace_steps}")  # fmt: skip
        grid = [
            {"max_uih": int(u), "batch_size": int(b), "mode": m}
            for u in args.max_uih.split(",")
            for b in args.batch.split(",")
            for m in args.modes.split(",")
        ]
        for point in grid:  # every config checked before the first run starts
            overrides = [*args.overrides, *(f"{k}={v}" for k, v in point.items())]
            build_config(args.preset, overrides, on_deprecated=_flat_keys)
        base = read_baseline(args.baseline, args.overrides) if args.baseline else {}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    raw = out.parent / f"{out.name}-steps"
    raw.mkdir(parents=True, exist_ok=True)
    if args.point:
        print(POINT_TAG + json.dumps(run_point(args, json.loads(args.point), raw)), flush=True)
        return 0
    rows = []
    for k, point in enumerate(grid, 1):
        try:
            row = median_row([spawn_point(args, point) for _ in range(args.repeat)])
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        rows.append(row)
        print(
            f"[{k}/{len(grid)}] uih={row['max_uih']} B={row['batch_size']} {row['mode']}: "
            f"step {row['step_ms']:.2f} ms  host {_f(row['host_ms'], '.2f')} ms  "
            f"idle {_f(row['gpu_idle_pct'], '.2f')}%  peak {_f(row['peak_mem_gb'], '.2f')} GB  "
            f"({row['point_s']:.1f} s)"
            + (f"  graphs {row['graphs_captured']}" if "graphs_captured" in row else ""),
            flush=True,
        )
        add_memory_ratios(rows)
        write(args, rows, [])  # so far: a run cut short by a timeout still leaves its rows
    add_memory_ratios(rows)
    failures = check_baseline(rows, base, args.tolerance)
    write(args, rows, failures)
    print("\n".join(table(rows)))
    for f in failures:
        print(f"REGRESSION: {f}", file=sys.stderr)
    print(json.dumps({"benchmark": "overhead", "rows": rows, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
