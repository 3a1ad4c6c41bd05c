"""Baseline training runs (paper §5 set-up): sync ("vanilla TorchRec") vs sdd.

For each (max UIH, local batch, mode) it runs `freescale train` with the
given preset on ``--nproc`` ranks and records per-step time, QPS, straggler %
and exposed communication per category (means over post-warm-up steps).

    python benchmarks/train_baseline.py --preset h200-21k --nproc 2 \\
        --max-uih 8000,21000 --batch 32,128 --modes sync,sdd

Prints a table, writes markdown + JSON to benchmarks/results/, ends with one
JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

from freescale.pipeline.config import build_config
from freescale.pipeline.launch import launch
from freescale.pipeline.timing import CATEGORIES


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="demo")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--max-uih", default="8000,21000")
    p.add_argument("--batch", default="32,128")
    p.add_argument("--modes", default="sync,sdd")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out", default=f"benchmarks/results/train-baseline-{date.today()}")
    args = p.parse_args()
    rows = []
    for max_uih in (int(x) for x in args.max_uih.split(",")):
        for batch in (int(x) for x in args.batch.split(",")):
            for mode in args.modes.split(","):
                cfg = build_config(
                    args.preset,
                    [
                        *args.overrides,
                        f"nproc={args.nproc}",
                        f"mode={mode}",
                        f"max_uih={max_uih}",
                        f"batch_size={batch}",
                        f"steps={args.steps}",
                        f"warmup={args.warmup}",
                        "progress=false",
                        "eval_every=0",
                    ],
                )
                start = time.perf_counter()
                summary = launch(cfg)
                assert summary is not None
                row = {
                    "max_uih": max_uih,
                    "batch": batch,
                    "mode": mode,
                    "wall_s": time.perf_counter() - start,
                    **summary,
                }
                rows.append(row)
                print(_line(row), flush=True)
    _write(args, rows)
    print(json.dumps({"benchmark": "train_baseline", "rows": rows}))
    return 0


def _line(r: dict) -> str:
    exp = " ".join(f"{c}={r['exposed_comm_ms'][c]:.2f}" for c in CATEGORIES)
    return (
        f"uih={r['max_uih']:>6} B={r['batch']:>4} {r['mode']:>4}: step {r['step_ms']:8.2f} ms"
        f"  qps {r['qps']:>10.0f}  straggler {r['straggler_pct']:5.2f}%  exposed[{exp}]"
    )


def _write(args: argparse.Namespace, rows: list[dict]) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor()
    head = (
        "| max UIH | batch/rank | mode | step ms | QPS (items/s) | straggler % | "
        + " | ".join(f"{c} ms" for c in CATEGORIES)
        + " |"
    )
    lines = [
        "# Baseline training: sync vs sdd",
        "",
        f"- date: {date.today()}",
        f"- machine: {args.nproc} x {gpu}, torch {torch.__version__}",
        f"- command: `python {' '.join(sys.argv)}`",
        "",
        "Means over post-warm-up steps; exposed communication is per step, mean over ranks.",
        "",
        head,
        "|" + "---|" * (6 + len(CATEGORIES)),
    ]
    for r in rows:
        lines.append(
            f"| {r['max_uih']} | {r['batch']} | {r['mode']} | {r['step_ms']:.2f} | "
            f"{r['qps']:.0f} | {r['straggler_pct']:.2f} | "
            + " | ".join(f"{r['exposed_comm_ms'][c]:.3f}" for c in CATEGORIES)
            + " |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
