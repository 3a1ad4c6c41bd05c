"""``freescale report``: metrics JSON lines -> markdown summary + PNG plots."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from freescale.observe.report import markdown, plot, read_metrics
from freescale.run.run_dir import METRICS


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="summarize a metrics file (markdown + PNG plots)")
    p.add_argument(
        "metrics",
        help="JSON-lines file written by `freescale train`, or a run directory (output.dir)",
    )
    p.add_argument(
        "--out",
        default=None,
        help="output folder (default: the run directory, or beside the metrics file)",
    )
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the means")
    p.add_argument("--title", default="FreeScale training report")
    p.set_defaults(run=run_report)


def run_report(args: argparse.Namespace) -> int:
    metrics = Path(args.metrics)
    if metrics.is_dir():  # a run directory: its metrics in, its report beside them
        default_out, metrics = metrics, metrics / METRICS
    else:
        default_out = metrics.with_suffix("")
    records = read_metrics(metrics)
    out = Path(args.out) if args.out else default_out
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(records, args.warmup, args.title)
    if importlib.util.find_spec("matplotlib") is not None:
        images = plot(records, out)
        text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in images) + "\n"
    else:
        print(
            "matplotlib not installed (pip install 'freescale[bench]'): no plots", file=sys.stderr
        )
    (out / "report.md").write_text(text)
    print(text)
    print(f"wrote {out / 'report.md'}", file=sys.stderr)
    return 0
