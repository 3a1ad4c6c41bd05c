"""Shared machinery of the training sweeps (train_baseline.py, straggler.py, scaling.py).

Each point of the grid (world size x max UIH x batch x mode x balance) is one
`freescale train` run (`launch`), recording means over post-warm-up steps:
step time, QPS, straggler %, compute time, exposed communication per
category. Every point also keeps its raw per-step metrics (JSON lines) and,
with ``--trace-steps``, a profiler trace of those steps and its GPU idle
summary (`freescale.pipeline.trace`). Prints one line per point, writes
markdown + JSON (+ plots against world size when several are swept), ends
with one JSON line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from datetime import date
from pathlib import Path

import torch

from freescale.pipeline.config import build_config
from freescale.pipeline.launch import launch
from freescale.pipeline.timing import CATEGORIES

AXES = ("nproc", "max_uih", "batch_size", "mode", "balance")


def parser(description: str, defaults: dict[str, str], out: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--preset", default="demo")
    p.add_argument("--nproc", default=defaults.get("nproc", "2"), help="world sizes, e.g. 2,4")
    p.add_argument("--max-uih", default=defaults.get("max_uih", "8000,21000"))
    p.add_argument("--batch", default=defaults.get("batch_size", "32,128"))
    p.add_argument("--modes", default=defaults.get("mode", "sync"))
    p.add_argument("--balance", default=defaults.get("balance", "none"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--trace-steps", default="", help="e.g. 20-21: trace these steps per point")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument(
        "--vary",
        action="append",
        default=list(defaults.get("vary", [])),
        help="one more grid axis: any config key, e.g. step_overlap=1,0.5,0",
    )
    p.add_argument("--out", default=f"benchmarks/results/{out}-{date.today()}")
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def run(args: argparse.Namespace, title: str) -> list[dict]:
    out = Path(args.out)
    raw = out.parent / f"{out.name}-steps"
    raw.mkdir(parents=True, exist_ok=True)
    extra_axes = dict(v.split("=", 1) for v in args.vary)
    grid = list(
        itertools.product(
            _ints(args.nproc),
            _ints(args.max_uih),
            _ints(args.batch),
            args.modes.split(","),
            args.balance.split(","),
            *(values.split(",") for values in extra_axes.values()),
        )
    )
    rows = []
    for k, point in enumerate(grid, 1):
        settings = dict(zip((*AXES, *extra_axes), point, strict=True))
        slug = "-".join(f"{a}{v}" for a, v in settings.items())
        extra = [f"metrics_path={raw / slug}.jsonl"]
        trace = raw / f"{slug}-trace.json.gz"
        if args.trace_steps:
            extra += [f"trace_path={trace}", f"trace_steps={args.trace_steps}"]
        cfg = build_config(args.preset, [
            *args.overrides, f"steps={args.steps}", f"warmup={args.warmup}",
            "progress=false", "eval_every=0", *extra,
            *(f"{a}={v}" for a, v in settings.items()),
        ])  # fmt: skip
        start = time.perf_counter()
        summary = launch(cfg)
        assert summary is not None
        row = {**settings, **summary, "point_s": time.perf_counter() - start}
        if args.trace_steps and trace.exists() and (summary_ := trace_summary(trace)):
            row["trace"] = summary_
        rows.append(row)
        print(f"[{k}/{len(grid)}] {line(row)}", flush=True)
    write(args, rows, title)
    print(json.dumps({"benchmark": Path(sys.argv[0]).stem, "rows": rows}))
    return rows


def script(doc: str, defaults: dict[str, str], out: str, title: str) -> int:
    """The whole main() of a sweep script: its first doc paragraph, grid defaults,
    output stem and report title."""
    run(parser(doc.split("\n\n")[0], defaults, out).parse_args(), title)
    return 0


def trace_summary(path: Path) -> dict | None:
    """Rank 0's GPU idle time over the traced steps (None for a CPU run)."""
    from freescale.pipeline.trace import gpu_gaps, load_trace

    devices = gpu_gaps(load_trace(path)).devices
    if not devices:
        return None
    dev = devices[0]
    return {
        "file": path.name,
        "window_ms": dev.window_us / 1000,
        "gpu_idle_pct": dev.idle_pct,
        "compute_stream_idle_pct": dev.compute_idle_pct,
        "nccl_ms": dev.comm_us / 1000,
        "top_gaps": [
            {"ms": g.dur_us / 1000, "cpu": g.cpu}
            for g in sorted(dev.gaps, key=lambda g: -g.dur_us)[:5]
        ],
    }


def line(r: dict) -> str:
    exp = " ".join(f"{c}={r['exposed_comm_ms'][c]:.2f}" for c in CATEGORIES)
    idle = f"  gpu idle {r['trace']['gpu_idle_pct']:.1f}%" if "trace" in r else ""
    return (
        f"W={r['nproc']} uih={r['max_uih']:>6} B={r['batch_size']:>4} {r['mode']:>4} "
        f"{r['balance']:>4}: step {r['step_ms']:8.2f} ms  qps {r['qps']:>10.0f}  "
        f"straggler {r['straggler_pct']:5.2f}%  exposed[{exp}]{idle}"
    )


def write(args: argparse.Namespace, rows: list[dict], title: str) -> None:
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    meta = {
        "title": title,
        "date": str(date.today()),
        "machine": f"{torch.cuda.device_count()} x {gpu}, torch {torch.__version__}",
        "command": f"python {' '.join(sys.argv)}",
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    report(out, meta, rows)


def report(out: Path, meta: dict, rows: list[dict]) -> None:
    """Markdown (+ plots) of a sweep; `main` re-runs it from the JSON."""
    cols = " | ".join(f"{c} ms" for c in CATEGORIES)
    lines = [
        f"# {meta['title']}", "",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}",
        f"- command: `{meta['command']}`",
        f"- raw per-step metrics (and traces): `{out.name}-steps/`", "",
        "Means over post-warm-up steps. Exposed communication: per step, mean over ranks "
        "(time the compute stream waited). compute = step − exposed − data wait, mean over "
        "ranks. GPU idle: rank 0, traced steps, share of the window with no kernel or copy "
        "on any stream.", "",
        f"| GPUs | max UIH | batch/rank | mode | balance | step ms | compute ms | QPS (items/s) "
        f"| straggler % | {cols} | GPU idle % |",
        "|" + "---|" * (10 + len(CATEGORIES)),
    ]  # fmt: skip
    for r in rows:
        exp = " | ".join(f"{r['exposed_comm_ms'][c]:.3f}" for c in CATEGORIES)
        idle = f"{r['trace']['gpu_idle_pct']:.2f}" if "trace" in r else "–"
        lines.append(
            f"| {r['nproc']} | {r['max_uih']} | {r['batch_size']} | {r['mode']} | "
            f"{r['balance']} | {r['step_ms']:.2f} | {r['compute_ms_mean']:.2f} | "
            f"{r['qps']:.0f} | {r['straggler_pct']:.2f} | {exp} | {idle} |"
        )
    plots = plot_world_sizes(rows, out)
    lines += ["", *(f"![{p.stem}]({p.name})" for p in plots)]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def plot_world_sizes(rows: list[dict], out: Path) -> list[Path]:
    """Straggler % and QPS against world size, one line per (max UIH, batch, mode, balance)."""
    if len({r["nproc"] for r in rows}) < 2:
        return []
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install .[bench]): no plots", file=sys.stderr)
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series: dict[tuple, list[dict]] = {}
    for r in rows:
        series.setdefault((r["max_uih"], r["batch_size"], r["mode"], r["balance"]), []).append(r)
    for (uih, b, mode, bal), pts in sorted(series.items()):
        pts.sort(key=lambda r: r["nproc"])
        label = f"{bal} (UIH {uih // 1000}k, B{b}{'' if mode == 'sync' else ', ' + mode})"
        style = "--" if uih < max(s[0] for s in series) else "-"
        x = [r["nproc"] for r in pts]
        axes[0].plot(x, [r["straggler_pct"] for r in pts], style, marker="o", label=label)
        axes[1].plot(x, [r["qps"] / 1e6 for r in pts], style, marker="o", label=label)
    for ax, ylabel in zip(axes, ("straggler %", "QPS (M items/s)"), strict=True):
        ax.set_xlabel("GPUs")
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted({r["nproc"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize="small")
    fig.tight_layout()
    path = out.parent / f"{out.name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path]


def main() -> int:
    """``python benchmarks/sweep.py OUT.json``: rewrite OUT.md (and plots) from OUT.json."""
    path = Path(sys.argv[1])
    data = json.loads(path.read_text())
    rows = data.pop("rows")
    report(path.with_suffix(""), data, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
