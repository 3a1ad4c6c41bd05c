"""Simulator speed: ``freescale.sim.simulate`` on ``--steps`` steps × ``--world`` ranks.

Target (issue 16): 10,000 steps × 512 ranks in under a minute on one core.
Two times are reported separately, because they scale differently:

- workload: drawing the synthetic per-sample lengths and summing them into
  per-rank features (``synthetic_features``; a Python loop over steps, cost
  ∝ steps × W × batch size); no partitioner;
- simulate: the timeline itself for each mode (vectorized over steps and
  ranks; cost ∝ steps × W, independent of the batch size).

Run with one BLAS/OpenMP thread for a one-core figure:

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 \\
        python benchmarks/simulate.py [--steps 10000] [--world 512] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date

from freescale.sim import MODES, ComputeModel, LengthSpec, SimConfig, simulate, synthetic_features

# The CLI's default (uncalibrated for W > 2) model: the speed does not depend on it.
MODEL = ComputeModel(a=15.58, s=0.1217, b=7.376e-5, c=2.074e-8, d=0.0, e=0.0, jitter_sigma=0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--world", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--out", default=None, help="markdown report to write")
    args = ap.parse_args()

    t0 = time.perf_counter()
    feats = synthetic_features(LengthSpec(), args.steps, args.world, args.batch_size, seed=0)
    t_workload = time.perf_counter() - t0
    rows = []
    for mode in MODES:
        t0 = time.perf_counter()
        out = simulate(feats, MODEL, SimConfig(mode=mode, dense_mb=100.0), seed=0)
        elapsed = time.perf_counter() - t0
        rows.append({"mode": mode, "simulate_s": elapsed, **out.summary()})

    threads = {k: os.environ.get(k, "unset") for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    lines = [
        "# Simulator speed (benchmarks/simulate.py)",
        "",
        f"- date: {date.today().isoformat()}",
        f"- machine: {platform.node() or 'vm'}, {platform.machine()}, {os.cpu_count()} cores,"
        f" python {platform.python_version()}; threads {threads}",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- size: {args.steps} steps × {args.world} ranks, batch {args.batch_size} per rank",
        f"- workload (synthetic lengths → per-rank features): {t_workload:.1f} s",
        "",
        "| mode | simulate s | step ms | straggler % | ids ms | emb ms | grad ms | dense ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['mode']} | {r['simulate_s']:.2f} | {r['step_ms']:.1f} | {r['straggler_pct']:.2f}"
            f" | {r['ids_ms']:.3f} | {r['emb_ms']:.3f} | {r['grad_ms']:.3f} | {r['dense_ms']:.3f} |"
        )
    lines += [
        "",
        "Step times and exposed communication above use placeholder link models and a",
        "2-GPU compute fit: they show that the run completes, they are not projections.",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(json.dumps({"workload_s": t_workload, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
