"""Shared machinery of the training sweeps (train_baseline.py, straggler.py).

Each point of the grid is one `freescale train` run (`launch`), recording
means over post-warm-up steps: step time, QPS, straggler %, compute time,
exposed communication per category. Prints one line per point, writes
markdown + JSON, ends with one JSON line.
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

AXES = ("max_uih", "batch_size", "mode", "balance")


def parser(description: str, defaults: dict[str, str], out: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--preset", default="demo")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--max-uih", default=defaults.get("max_uih", "8000,21000"))
    p.add_argument("--batch", default=defaults.get("batch_size", "32,128"))
    p.add_argument("--modes", default=defaults.get("mode", "sync"))
    p.add_argument("--balance", default=defaults.get("balance", "none"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out", default=f"benchmarks/results/{out}-{date.today()}")
    return p


def run(args: argparse.Namespace, title: str) -> list[dict]:
    grid = itertools.product(
        [int(x) for x in args.max_uih.split(",")],
        [int(x) for x in args.batch.split(",")],
        args.modes.split(","),
        args.balance.split(","),
    )
    rows = []
    for point in grid:
        settings = dict(zip(AXES, point, strict=True))
        cfg = build_config(args.preset, [
            *args.overrides, f"nproc={args.nproc}", f"steps={args.steps}",
            f"warmup={args.warmup}", "progress=false", "eval_every=0",
            *(f"{k}={v}" for k, v in settings.items()),
        ])  # fmt: skip
        start = time.perf_counter()
        summary = launch(cfg)
        assert summary is not None
        row = {**settings, "wall_s": time.perf_counter() - start, **summary}
        rows.append(row)
        print(line(row), flush=True)
    write(args, rows, title)
    print(json.dumps({"benchmark": Path(sys.argv[0]).stem, "rows": rows}))
    return rows


def line(r: dict) -> str:
    exp = " ".join(f"{c}={r['exposed_comm_ms'][c]:.2f}" for c in CATEGORIES)
    return (
        f"uih={r['max_uih']:>6} B={r['batch_size']:>4} {r['mode']:>4} {r['balance']:>4}: "
        f"step {r['step_ms']:8.2f} ms  qps {r['qps']:>10.0f}  "
        f"straggler {r['straggler_pct']:5.2f}%  exposed[{exp}]"
    )


def write(args: argparse.Namespace, rows: list[dict], title: str) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    cols = " | ".join(f"{c} ms" for c in CATEGORIES)
    lines = [
        f"# {title}", "",
        f"- date: {date.today()}",
        f"- machine: {args.nproc} x {gpu}, torch {torch.__version__}",
        f"- command: `python {' '.join(sys.argv)}`", "",
        "Means over post-warm-up steps. Exposed communication: per step, mean over ranks "
        "(time the compute stream waited). compute = step − exposed − data wait, mean over "
        "ranks.", "",
        f"| max UIH | batch/rank | mode | balance | step ms | compute ms | QPS (items/s) | "
        f"straggler % | {cols} |",
        "|" + "---|" * (8 + len(CATEGORIES)),
    ]  # fmt: skip
    for r in rows:
        exp = " | ".join(f"{r['exposed_comm_ms'][c]:.3f}" for c in CATEGORIES)
        lines.append(
            f"| {r['max_uih']} | {r['batch_size']} | {r['mode']} | {r['balance']} | "
            f"{r['step_ms']:.2f} | {r['compute_ms_mean']:.2f} | {r['qps']:.0f} | "
            f"{r['straggler_pct']:.2f} | {exp} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
