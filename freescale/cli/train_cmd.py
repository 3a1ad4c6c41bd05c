"""``freescale train``: the staged training pipeline on CPU ranks or GPUs."""

from __future__ import annotations

import argparse
import json

from freescale.pipeline.config import MODES, PRESETS, build_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train the reference model (default: 2 CPU ranks, synthetic long-tail data)",
        description="Train with the staged pipeline. Under torchrun each process is one rank; "
        "otherwise --nproc ranks are spawned here (gloo on CPU, one GPU each with NCCL).",
    )
    p.add_argument("--preset", default="demo", choices=sorted(PRESETS))
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (repeatable), e.g. --set mode=sdd",
    )
    p.add_argument("--mode", choices=list(MODES), help="shortcut for --set mode=...")
    p.add_argument("--nproc", type=int, help="shortcut for --set nproc=...")
    p.add_argument("--print-config", action="store_true", help="print the config and exit")
    p.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.mode:
        overrides.append(f"mode={args.mode}")
    if args.nproc is not None:
        overrides.append(f"nproc={args.nproc}")
    cfg = build_config(args.preset, overrides)  # ValueError -> one clear line
    if args.print_config:
        print(json.dumps(cfg.as_dict()))
        return 0
    from freescale.pipeline.launch import launch, under_torchrun
    from freescale.pipeline.setup import check_data

    if not under_torchrun():
        check_data(cfg, cfg.nproc)  # bad data/config: one line here, not N worker tracebacks
    summary = launch(cfg)
    if summary is not None:
        print(json.dumps({"command": "train", "preset": args.preset, **summary}))
    return 0
