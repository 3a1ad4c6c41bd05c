"""``freescale eval CHECKPOINT``: a saved model on its data's validation and test splits."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from freescale.cli.config_args import add_code_args
from freescale.config import BalanceSection, CheckpointSection, OutputSection, TrainConfig
from freescale.config.files import load_config
from freescale.data.source import schema_of
from freescale.run.run_dir import in_run_dir
from freescale.serving.checkpoint import check_schema, confirm_code, relocated
from freescale.state.checkpoint import find_checkpoint, read_manifest
from freescale.state.data_record import data_file_sha256, schema_from_record


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="evaluate a checkpoint (file data: HR@10, NDCG@10, AUC, NE on valid and test)",
        description="Load a checkpoint with the config it was written with (same data, "
        "same world size) and evaluate it; no training step is taken.",
    )
    p.add_argument(
        "checkpoint",
        nargs="?",
        help="a checkpoint directory, or a checkpoint_dir (its newest); "
        "default: the newest in the --config's checkpoint.dir",
    )
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="the run's config file (e.g. runs/NAME/config.toml) instead of the checkpoint's",
    )
    add_code_args(p, data_moves=True)
    p.set_defaults(run=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    given = None
    if args.config is not None:
        given = in_run_dir(load_config(args.config))
    where = args.checkpoint or (given.checkpoint.dir if given else "")
    if not where:
        raise ValueError("which checkpoint? name it, or give a --config with checkpoint.dir")
    found = find_checkpoint(where)
    if found is None:
        raise ValueError(f"no complete checkpoint in {where!r}")
    manifest = read_manifest(found)
    saved = given or TrainConfig.from_dict(manifest["config"])
    if given is None:  # the checkpoint's config: it may not choose the code that runs
        confirm_code(saved, args.model, args.data, "eval")
    saved = relocated(saved, args.data, found)  # --data: where the run's data is now
    cfg = replace(
        saved.with_values(
            checkpoint=CheckpointSection(resume=str(found)),
            output=OutputSection(progress=False),  # writes nothing: the summary line is its output
            balance=BalanceSection(),  # evaluation balances nothing: no partitioner is imported
        ),
        eval_only=True,
    )
    from freescale.pipeline.setup import check_data
    from freescale.run.checks import check_launch
    from freescale.run.launch import launch

    check_launch(cfg)
    try:
        source = check_data(cfg, cfg.run.nproc)
    except ValueError as e:  # the line names the command that runs
        raise ValueError(str(e) if str(e).startswith("eval:") else f"eval: {e}") from None
    record = manifest.get("data")
    if record is not None:
        check_schema(schema_from_record(record["schema"]), schema_of(source), cfg.data.source,
                     "eval")  # fmt: skip
        digest = record.get("sha256")
        if digest and data_file_sha256(cfg.data.source) not in (None, digest):
            notice_line(f"{cfg.data.source} differs from the file the run read (SHA-256)")
    summary = launch(cfg, checked=True)
    if summary is not None:
        print(json.dumps({"command": "eval", "checkpoint": str(found), **summary}), flush=True)
    return 0


def notice_line(text: str) -> None:
    print(f"freescale eval: {text}", file=sys.stderr, flush=True)
