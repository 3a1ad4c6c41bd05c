"""``freescale eval CHECKPOINT``: a saved model on its data's validation and test splits."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from freescale.pipeline.checkpoint import find_checkpoint, read_manifest
from freescale.pipeline.config import CheckpointSection, TrainConfig


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a checkpoint (file data: HR@10, NDCG@10, AUC, NE on valid and test)",
        description="Load a checkpoint with the config it was written with (same data, "
        "same world size) and evaluate it; no training step is taken.",
    )
    p.add_argument("checkpoint", help="a checkpoint directory, or a checkpoint_dir (its newest)")
    p.set_defaults(run=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    found = find_checkpoint(args.checkpoint)
    if found is None:
        raise ValueError(f"no complete checkpoint in {args.checkpoint!r}")
    manifest = read_manifest(found)  # its config: nested, or flat (older checkpoints)
    saved = TrainConfig.from_dict(manifest["config"])
    cfg = replace(
        saved.with_values(
            checkpoint=CheckpointSection(resume=str(found)),
            output__metrics_path="",
            output__trace_path="",
            output__progress=False,
        ),
        eval_only=True,
    )
    from freescale.pipeline.checks import check_launch
    from freescale.pipeline.launch import launch
    from freescale.pipeline.setup import check_data

    check_launch(cfg)
    check_data(cfg.data, cfg.run, cfg.run.nproc)
    summary = launch(cfg, checked=True)
    if summary is not None:
        print(json.dumps({"command": "eval", "checkpoint": str(found), **summary}), flush=True)
    return 0
