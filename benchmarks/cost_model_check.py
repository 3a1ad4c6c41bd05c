"""Cost model vs measured per-rank compute on held-out GPU steps (issue 15, point 5).

The step JSON lines of the GPU runs (``benchmarks/results/*-steps/*.jsonl``)
hold per-rank ``compute_ms`` but no per-rank batch features (only the global
``samples`` and ``items``). The synthetic data is a pure function of (seed,
global sample index), so for runs whose plan depends on the lengths only
(``balance=none``: the loader's batches; ``fbs``: the FBS plan of them) this
script rebuilds every rank's summed features (1, L, L², N, ΣL_can) and checks
the rebuild against the logged global ``items`` of every step. It then fits
`CostModel` on the first half of the post-warm-up steps and predicts the
second half: per-rank time error, and error of the rank-to-rank difference
(what the balancer acts on). Runs planned by ``cost`` or ``vbs`` depend on
the measured times through the fit / AutoTune and are not rebuilt here.

    python benchmarks/cost_model_check.py FILE.jsonl [...] [--warmup 10]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import numpy as np
import torch

from freescale.balance import FBS, CostModel, CostModelConfig, RuntimeInfo, WorldLengths
from freescale.balance.world import sample_features
from freescale.pipeline.config import build_config
from freescale.pipeline.setup import make_source


def run_params(path: Path) -> dict[str, int | str]:
    m = re.search(r"nproc(\d+)-max_uih(\d+)-batch_size(\d+)-mode(\w+?)-balance(\w+)", path.name)
    if not m:
        raise ValueError(f"cannot parse run parameters from {path.name}")
    w, uih, b, mode, balance = m.groups()
    return {"W": int(w), "max_uih": int(uih), "B": int(b), "mode": mode, "balance": balance}


def step_world(source, step: int, w: int, b: int) -> tuple[WorldLengths, int]:
    """The raw world of one step (rank-major) and its item count (UIH + candidates)."""
    uih, ncand, clen, items = [], [], [], 0
    for g in range(step * w * b, (step + 1) * w * b):
        s = source.raw_sample(g)
        uih.append(len(s.uih_ids))
        ncand.append(len(s.cand_ids))
        clen.extend(int(c) for c in s.content_lengths)
        items += len(s.uih_ids) + len(s.cand_ids)
    world = WorldLengths(
        (b,) * w, torch.tensor(uih), torch.tensor(ncand), torch.tensor(clen, dtype=torch.int64)
    )
    return world, items


def rank_features(world: WorldLengths, balance: str) -> torch.Tensor:
    w = world.world_size
    dest = world.source_ranks() if balance == "none" else FBS()(world, RuntimeInfo()).dest()
    out = torch.zeros(w, 5, dtype=torch.float64)
    return out.index_add_(0, dest, sample_features(world))


def check(path: Path, warmup: int) -> dict:
    p = run_params(path)
    if p["balance"] not in ("none", "fbs"):
        raise ValueError(f"{path.name}: only balance=none|fbs runs can be rebuilt")
    cfg = build_config("h200-21k", [f"nproc={p['W']}", f"batch_size={p['B']}",
                                    f"max_uih={p['max_uih']}"])  # fmt: skip
    source = make_source(cfg)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    feats, times, matched = [], [], 0
    for r in rows:
        world, items = step_world(source, r["step"], p["W"], p["B"])
        matched += items == r["items"]
        feats.append(rank_features(world, str(p["balance"])))
        times.append(np.asarray(r["compute_ms"], dtype=np.float64))
    steps = list(range(warmup, len(rows)))
    half = len(steps) // 2
    model = CostModel(CostModelConfig(window=half))
    for s in steps[:half]:
        model.observe(feats[s], times[s])
    pred = np.stack([model.predict(feats[s]).numpy() + model.intercept for s in steps[half:]])
    meas = np.stack([times[s] for s in steps[half:]])
    diff_p, diff_m = pred - pred.mean(1, keepdims=True), meas - meas.mean(1, keepdims=True)
    return {
        "run": f"{path.parent.name}/{path.name}",
        "rebuilt_steps_matching_items": f"{matched}/{len(rows)}",
        "coefficients": [float(f"{c:.4g}") for c in model.coefficients],
        "intercept_ms": round(model.intercept, 2),
        "test_steps": len(steps) - half,
        "rank_time_mape_pct": round(100 * float(np.mean(np.abs(pred - meas) / meas)), 2),
        "rank_deviation_mae_ms": round(float(np.mean(np.abs(diff_p - diff_m))), 3),
        "measured_deviation_mean_abs_ms": round(float(np.mean(np.abs(diff_m))), 3),
        "deviation_corr": round(float(np.corrcoef(diff_p.ravel(), diff_m.ravel())[0, 1]), 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--warmup", type=int, default=10)
    args = ap.parse_args()
    results = [check(f, args.warmup) for f in args.files]
    keys = list(results[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in results:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    print(json.dumps(results), file=sys.stderr)


if __name__ == "__main__":
    main()
