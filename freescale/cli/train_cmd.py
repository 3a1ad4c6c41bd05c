"""``freescale train``: the staged training pipeline on CPU ranks or GPUs."""

from __future__ import annotations

import argparse
import json
import signal

from freescale.cli.config_args import add_config_args, config_from_args
from freescale.config import MODES, format_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train the reference model (default: 2 CPU ranks, synthetic long-tail data)",
        description="Train with the staged pipeline. Under torchrun each process is one rank; "
        "otherwise --nproc ranks are spawned here (gloo on CPU, one GPU each with NCCL).",
    )
    add_config_args(p)
    p.add_argument("--mode", choices=list(MODES), help="shortcut for --set run.mode=...")
    p.add_argument("--nproc", type=int, help="shortcut for --set run.nproc=...")
    p.add_argument(
        "--resume",
        nargs="?",
        const="",
        default=None,
        metavar="DIR|auto",
        help="continue from a checkpoint: DIR (a checkpoint or a checkpoint dir, its newest);"
        " without DIR, the newest in checkpoint.dir; 'auto': the newest in checkpoint.dir"
        " if there is one, else start at step 0 (the same command for a first start and"
        " a restart: torchrun --max-restarts)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the config as TOML (what --config reads) and exit",
    )
    p.set_defaults(run=run_train)


def run_train(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.mode:
        overrides.append(f"run.mode={args.mode}")
    if args.nproc is not None:
        overrides.append(f"run.nproc={args.nproc}")
    cfg = config_from_args(args, overrides)  # ValueError: one line
    if args.resume is not None:
        target = args.resume or cfg.checkpoint.dir
        if not target:
            raise ValueError("--resume without DIR needs checkpoint.dir to be set")
        cfg = cfg.with_values(checkpoint__resume=target)
    if args.print_config:
        print(format_config(cfg), end="")
        return 0
    from freescale.pipeline.liveness import EXIT_STOPPED, was_stopped
    from freescale.pipeline.setup import open_data
    from freescale.run.checks import check_launch
    from freescale.run.launch import launch, under_torchrun

    if not under_torchrun():
        signal.signal(signal.SIGTERM, _stopped_before_launch)  # exit 143, as later on
        check_launch(cfg)  # files, devices, the resume checkpoint
        open_data(cfg, cfg.run.nproc)  # bad data/config (run.epochs too): one line here
    summary = launch(cfg, checked=not under_torchrun())
    if summary is not None:
        # the preset is only where the keys started: the model and data say what ran
        ran = {"preset": args.preset, "model": cfg.model.factory, "data": cfg.data.source}
        print(json.dumps({"command": "train", **ran, **summary}), flush=True)
    # Stopped by SIGTERM after a clean step (and checkpoint): the conventional 143.
    stopped = was_stopped() or (summary is not None and summary.get("stopped"))
    return EXIT_STOPPED if stopped else 0


def _stopped_before_launch(signum: int, frame: object) -> None:
    from freescale.run.supervise import RunStopped

    raise RunStopped(signum)
