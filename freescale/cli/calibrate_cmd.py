"""``freescale calibrate``: fit the simulator's calibration from step JSON logs.

    freescale calibrate RUN.jsonl [...] [--warmup 10] [--balanced RUN.jsonl ...]
        [--bandwidth benchmarks/results/comm-bandwidth.md] [--inter ib-paper]
        --out calibration.json

Each log must carry ``rank_features`` (builds from 10827f2 on); older logs
are refused with the file named (benchmarks/sim_validate.py rebuilds their
features from the synthetic data instead). The fit itself is
`freescale.sim.calibrate.fit_runs` (docs/simulator.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from freescale.sim.calibrate import (
    PUBLISHED_LINKS,
    MeasuredRun,
    fit_runs,
    link_from_bandwidth,
    logged_features,
    read_steps,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="fit the simulator from step JSON logs")
    p.add_argument("logs", nargs="+", help="step JSON lines of unbalanced (or any) runs")
    p.add_argument("--balanced", nargs="*", default=[], help="logs of balanced runs")
    p.add_argument("--warmup", type=int, default=10, help="steps left out at the start")
    p.add_argument("--row-bytes", type=int, default=1024, help="embedding row bytes (256 fp32)")
    p.add_argument("--bandwidth", default=None, help="comm_bandwidth.py report (host tiers)")
    p.add_argument("--inter", default="ib-paper", choices=sorted(PUBLISHED_LINKS))
    p.add_argument("--out", required=True, help="calibration JSON to write")
    p.set_defaults(run=run_calibrate)


def _run(path: str, warmup: int, balanced: bool) -> MeasuredRun:
    try:
        rows = [r for r in read_steps(path) if r["step"] >= warmup]
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror}") from None
    if not rows:
        raise ValueError(f"{path}: no steps after the {warmup} warm-up steps")
    feats = logged_features(rows)
    if feats is None:
        raise ValueError(f"{path}: lines lack rank_features (log with a build from 10827f2 on)")
    return MeasuredRun(rows, feats, balanced)


def run_calibrate(args: argparse.Namespace) -> int:
    if args.warmup < 0 or args.row_bytes < 0:
        raise ValueError("--warmup and --row-bytes must be >= 0")
    runs = [_run(p, args.warmup, False) for p in args.logs]
    runs += [_run(p, args.warmup, True) for p in args.balanced]
    cal = fit_runs(runs, PUBLISHED_LINKS[args.inter]["link"], args.row_bytes)
    cal.sources = {
        "compute": "fit on " + ", ".join([*args.logs, *args.balanced]),
        "inter": "PUBLISHED, not measured: " + PUBLISHED_LINKS[args.inter]["source"],
        "intra": "effective, from the W > 1 logs' exposed ids/emb AllToAll (0 without any)",
    }
    if args.bandwidth:
        text = Path(args.bandwidth).read_text()
        for backend in ("smfree-shm", "smfree-gloo"):
            try:
                cal.host[backend] = link_from_bandwidth(text, "all_to_all", backend)
            except ValueError:
                continue
        cal.sources["host"] = f"{args.bandwidth}, all_to_all, messages >= 1 MB"
    Path(args.out).write_text(cal.to_json() + "\n")
    m = cal.compute
    print(f"compute: a {m.a:.4g} ms, s {m.s:.4g}, b {m.b:.4g}, c {m.c:.4g}, d {m.d:.4g},"
          f" e {m.e:.4g}; jitter sigma {m.jitter_sigma:.4f}")  # fmt: skip
    print(f"intra: alpha {cal.intra.alpha_ms:.4g} ms, beta {cal.intra.beta_ms_per_mb:.4g} ms/MB")
    print(f"fixed exposed ms: {cal.fixed_ms}")
    print(f"wrote {args.out}")
    return 0
