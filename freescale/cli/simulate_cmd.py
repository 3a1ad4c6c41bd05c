"""``freescale simulate``: project straggler %, exposed communication and QPS to
world sizes we cannot measure (the model and its limits: docs/simulator.md).

The simulator (`freescale.sim`, layer 2) takes balancing as an injected
callable; this command (layer 4) wires the real partitioners into it.

Default compute coefficients: the `CostModel` fit of
`git show aca6152:benchmarks/results/cost-model-check-2026-12-01.md` on the 2 × H200 h200-21k
``balance=none`` run (scaling-21k-2xH200-2026-11-29T2050): a = 15.58 ms,
0.1217 ms/sample, 7.376e-5 ms/token, 2.074e-8 ms/token². Link defaults are
placeholders, NOT calibrated. With ``--calibration FILE`` every model
parameter comes from a calibration file instead (benchmarks/sim_validate.py
writes one next to its validation report; quote projections with that error).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from freescale.balance import (
    CostModel,
    CostModelConfig,
    RuntimeInfo,
    WorldLengths,
    resolve_partitioner,
)
from freescale.sim import (
    ComputeModel,
    LengthSpec,
    LinkModel,
    SimConfig,
    StepLengths,
    simulate,
    synthetic_features,
)
from freescale.sim.calibrate import Calibration
from freescale.sim.workload import Assign

# a, s, b, c, d, e: see the module docstring (fitted on 2 GPUs, not validated).
DEFAULT_COEF = "15.58,0.1217,7.376e-5,2.074e-8,0,0"
COLUMNS = ("step_ms", "compute_ms", "qps", "straggler_pct", "ids_ms", "emb_ms", "grad_ms")


def _floats(text: str, n: int, name: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"{name} must be {n} comma-separated numbers, got {text!r}") from None
    if len(values) != n:
        raise ValueError(f"{name} must be {n} comma-separated numbers, got {text!r}")
    return values


def _names(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="project step time, straggler %% and QPS to W GPUs")
    p.add_argument("--world-sizes", default="8,64", help="comma-separated rank counts")
    p.add_argument("--modes", default="sync,sdd,freescale", help="sync, sdd, freescale")
    p.add_argument("--balance", default="none", help="partitioners: none, fbs, cost, ...")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip", type=int, default=0, help="steps left out of the means")
    p.add_argument("--batch-size", type=int, default=128, help="samples per rank")
    p.add_argument("--length-median", type=float, default=4500.0)
    p.add_argument("--length-sigma", type=float, default=0.55)
    p.add_argument("--length-cap", type=int, default=17_000)
    p.add_argument("--max-uih", type=int, default=21_000)
    p.add_argument("--max-candidates", type=int, default=8)
    p.add_argument("--max-content", type=int, default=4)
    p.add_argument("--coef", default=DEFAULT_COEF, help="a,s,b,c,d,e of the compute model")
    p.add_argument("--jitter", type=float, default=0.0, help="lognormal sigma per rank-step")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--intra", default="0.02,0.005", help="alpha_ms,beta_ms_per_mb (placeholder)")
    p.add_argument("--inter", default="0.05,0.02", help="alpha_ms,beta_ms_per_mb (placeholder)")
    p.add_argument("--embedding-dim", type=int, default=256)
    p.add_argument("--embedding-bytes", type=int, default=4)
    p.add_argument("--dense-mb", type=float, default=0.0)
    p.add_argument("--dense-tail", type=float, default=0.1)
    p.add_argument("--collision-share", type=float, default=0.213, help="freescale's κ")
    p.add_argument("--forward-fraction", type=float, default=1.0 / 3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--calibration",
        default=None,
        help="calibration JSON (freescale calibrate, benchmarks/sim_validate.py): replaces "
        "--coef, --jitter, --intra, --inter and adds the fixed exposed times",
    )
    p.add_argument("--json-out", default=None, help="also write the rows as JSON to this file")
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="a training config (freescale train --print-config): its mode, balance, batch "
        "size, lengths, seed and model dim, where not given here",
    )
    # Unset until run time: a value given here wins over the config's, the config's
    # over the default.
    defaults = {dest: p.get_default(dest) for dest in FROM_CONFIG}
    p.set_defaults(run=run_simulate, config_defaults=defaults, **dict.fromkeys(FROM_CONFIG))


def _builtin_dim(cfg: Any) -> int | None:
    from freescale.models.sequence import with_defaults

    return with_defaults(cfg.model.options)["dim"] if cfg.model.builtin else None


# what a training config (--config) gives: argument -> its value there (None: none)
FROM_CONFIG: dict[str, Callable[[Any], Any]] = {
    "modes": lambda c: c.run.mode,
    "balance": lambda c: c.balance.method,
    "batch_size": lambda c: c.run.batch_size,
    "length_median": lambda c: c.data.length_median,
    "length_sigma": lambda c: c.data.length_sigma,
    "length_cap": lambda c: c.data.length_cap,
    "max_uih": lambda c: c.data.max_uih,
    "max_candidates": lambda c: c.data.max_candidates,
    "max_content": lambda c: c.data.max_content,
    "seed": lambda c: c.run.seed,
    "embedding_dim": _builtin_dim,
}


def _with_config(args: argparse.Namespace) -> None:
    """Fill the arguments not given from ``--config`` (or their defaults)."""
    cfg = None
    if args.config is not None:
        from freescale.config.files import load_config

        cfg = load_config(args.config)
    for dest, get in FROM_CONFIG.items():
        if getattr(args, dest) is None:
            value = get(cfg) if cfg is not None else None
            setattr(args, dest, args.config_defaults[dest] if value is None else value)


def partitioner_assign(name: str, model: ComputeModel) -> Assign | None:
    """An `Assign` running partitioner ``name``; ``cost`` plans with the
    simulator's own coefficients (an oracle cost model, jitter aside)."""
    if name == "none":
        return None
    partition = resolve_partitioner(name)
    coef = tuple(float(v) for v in model.coefficients)
    cost_model = CostModel(CostModelConfig(prior=coef)) if sum(coef) > 0 else None

    def assign(lengths: StepLengths, step: int) -> np.ndarray:
        world = WorldLengths(
            lengths.batch_sizes,
            torch.from_numpy(lengths.uih),
            torch.from_numpy(lengths.num_candidates),
            torch.from_numpy(lengths.candidate_lengths),
        )
        plan = partition(world, RuntimeInfo(step=step, cost_model=cost_model))
        return plan.dest().numpy()

    return assign


def _load_calibration(path: str | None) -> Calibration | None:
    if path is None:
        return None
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read calibration {path}: {e.strerror}") from None
    return Calibration.from_json(text)


def run_simulate(args: argparse.Namespace) -> int:
    _with_config(args)
    if args.steps < 1 or not 0 <= args.skip < args.steps:
        raise ValueError(f"need steps >= 1 and 0 <= skip < steps, got {args.steps}, {args.skip}")
    cal = _load_calibration(args.calibration)
    if cal is None:
        model = ComputeModel(*_floats(args.coef, 6, "--coef"), jitter_sigma=args.jitter)
        intra = LinkModel(*_floats(args.intra, 2, "--intra"))
        inter = LinkModel(*_floats(args.inter, 2, "--inter"))
    else:
        model, intra, inter = cal.compute, cal.intra, cal.inter
    spec = LengthSpec(
        args.length_median, args.length_sigma, args.length_cap, args.max_uih,
        args.max_candidates, args.max_content,
    )  # fmt: skip
    worlds = [int(w) for w in _names(args.world_sizes)]
    modes, balances = _names(args.modes), _names(args.balance)
    rows = []
    for w in worlds:
        for balance in balances:
            assign = partitioner_assign(balance, model)
            feats = synthetic_features(spec, args.steps, w, args.batch_size, args.seed, assign)
            for mode in modes:
                fixed = {}
                if cal is not None:
                    fixed = cal.fixed_ms if balance == "none" else cal.fixed_ms_balanced
                cfg = SimConfig(
                    mode=mode,
                    intra=intra,
                    inter=inter,
                    fixed_ms=dict(fixed),
                    forward_barrier=cal is not None and balance == "none" and w > 1,
                    gpus_per_node=args.gpus_per_node,
                    embedding_dim=args.embedding_dim,
                    embedding_bytes=args.embedding_bytes,
                    dense_mb=args.dense_mb,
                    dense_tail=args.dense_tail,
                    collision_share=args.collision_share,
                    forward_fraction=args.forward_fraction,
                )
                summary = simulate(feats, model, cfg, seed=args.seed).summary(args.skip)
                rows.append({"world_size": w, "balance": balance, "mode": mode, **summary})
    print("| W | balance | mode | " + " | ".join(COLUMNS) + " | dense_ms | meta_ms |")
    print("|---" * (len(COLUMNS) + 5) + "|")
    for r in rows:
        cols = (*COLUMNS, "dense_ms", "meta_ms")
        cells = [f"{r[c]:.0f}" if c == "qps" else f"{r[c]:.3f}" for c in cols]
        print(f"| {r['world_size']} | {r['balance']} | {r['mode']} | " + " | ".join(cells) + " |")
    if cal is None:
        note = "compute: 2-GPU fit, not validated; links: placeholders, not calibrated"
    else:
        note = f"calibration {args.calibration}: see its sources and the validation report"
    result = {"calibration": note, "rows": rows}
    print(json.dumps(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1) + "\n")
    return 0
