"""``freescale export CHECKPOINT OUT``: a trained run as a servable program."""

from __future__ import annotations

import argparse
import json
import sys

from freescale.cli.config_args import add_code_args

_CHOICES = (
    ("--weights", ("auto", "best", "latest"),
     "auto (default): the best evaluation's weights where the run kept them "
     "(evaluation.keep_best), else the latest; best; latest"),
    ("--attention", ("jagged", "padded"),
     "jagged: the model's own attention as one op per pattern (Σ L² work; loads where "
     "freescale is imported); padded: the batch padded to its widest sample (B·L_max² work; "
     "a self-contained program)"),
    ("--amp", ("auto", "bf16", "none"),
     "auto (default): bf16 autocast in the program where the run trained with "
     "dense.amp=bf16 and --device is cuda, else none; bf16; none"),
)  # fmt: skip


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="export a checkpoint's model (torch.export program, optional AOTInductor package)",
        description="Check a checkpoint as --resume does, load its gathered tables and dense "
        "weights into the plain model its run's factory builds (no process group; any world "
        "size), and export it with torch.export over dynamic jagged inputs: OUT/model.pt2, "
        "OUT/manifest.json, and with --aoti OUT/model_aoti.pt2 (docs/serving.md).",
    )
    p.add_argument("checkpoint", help="a checkpoint directory, or a checkpoint_dir (its newest)")
    p.add_argument("out", help="the export directory (created)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="device to serve on")
    p.add_argument(
        "--dynamic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="one program for every batch shape (default); --no-dynamic: the example's shapes",
    )
    p.add_argument("--aoti", action="store_true", help="also compile an AOTInductor package")
    for flag, choices, what in _CHOICES:  # the first choice is the default
        p.add_argument(flag, choices=choices, default=choices[0], help=what)
    add_code_args(p)
    p.set_defaults(run=run_export)


def run_export(args: argparse.Namespace) -> int:
    from freescale.serving.exporter import export
    from freescale.serving.loader import read_manifest

    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is visible")
    out = export(args.checkpoint, args.out, model=args.model, data=args.data,
                 device=args.device, dynamic=args.dynamic, aoti=args.aoti,
                 attention=args.attention, weights=args.weights, amp=args.amp,
                 say=_say)  # fmt: skip
    manifest = read_manifest(out)
    record = {"command": "export", "out": str(out), "files": sorted(manifest["files"]),
              "checkpoint_sha256": manifest["source"]["manifest_sha256"]}  # fmt: skip
    print(json.dumps(record), flush=True)
    return 0


def _say(msg: str) -> None:
    print(f"freescale export: {msg}", file=sys.stderr, flush=True)
