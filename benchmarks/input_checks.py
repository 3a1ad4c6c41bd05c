"""Cost of the host-side input checks (`freescale.pipeline.inputs.find_problem`)
per batch, next to the batch build time, for the demo and the h200-8k shapes.

    python benchmarks/input_checks.py

Prints a table and one JSON line. The checks run in the loader (a DataLoader
worker on GPUs), before the copy; the per-step agreement is one gloo
all-gather of 6 int64 per rank, measured by the trainer as part of "data".
"""

from __future__ import annotations

import json
import time

from freescale.pipeline.config import build_config
from freescale.pipeline.inputs import Limits, find_problem
from freescale.pipeline.setup import make_source


def measure(preset: str, overrides: list[str], reps: int = 20) -> dict:
    cfg = build_config(preset, overrides)
    source = make_source(cfg)
    limits = Limits(source.num_items, 4)
    batches, t0 = [], time.perf_counter()
    for step in range(reps):
        batches.append(source.batch(step, 0, cfg.nproc, cfg.batch_size))
    build_ms = (time.perf_counter() - t0) * 1000 / reps
    t0 = time.perf_counter()
    for b in batches:
        assert find_problem(b, limits) is None
    check_ms = (time.perf_counter() - t0) * 1000 / reps
    tokens = sum(int(b.uih.offsets[-1]) for b in batches) // reps
    return {"preset": preset, "batch": cfg.batch_size, "uih_tokens": tokens,
            "build_ms": round(build_ms, 3), "check_ms": round(check_ms, 3)}  # fmt: skip


def main() -> None:
    rows = [measure("demo", []), measure("h200-8k", ["device=auto", "num_items=1000000"], 5)]
    print(f"{'preset':10} {'batch':>5} {'uih tokens':>10} {'build ms':>9} {'check ms':>9}")
    for r in rows:
        print(f"{r['preset']:10} {r['batch']:5} {r['uih_tokens']:10} {r['build_ms']:9.2f}"
              f" {r['check_ms']:9.3f}")  # fmt: skip
    print(json.dumps({"benchmark": "input_checks", "rows": rows}))


if __name__ == "__main__":
    main()
