"""``freescale data convert`` and ``freescale data split`` (`freescale.data.convert`,
`freescale.data.split`): progress on stderr, one JSON line on stdout."""

from __future__ import annotations

import argparse
import json


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(data_sub: argparse._SubParsersAction) -> None:
    convert = data_sub.add_parser(
        "convert",
        help="write a sasrec/movielens/parquet/csv file as parquet-stream Parquet (same ids)",
        description="Read SRC with its in-memory reader and write its users, in the reader's "
        "order and with its item ids, as a directory of Parquet files in the parquet-stream "
        "layout (docs/train-on-your-data.md).",
    )
    convert.add_argument(
        "src",
        help="sasrec:PATH | movielens:PATH | parquet:PATH | csv:PATH | events:PATH (Parquet, "
        "one row per event: user_id, item_id, timestamp[, action], sorted by user_id)",
    )
    convert.add_argument("dst", help="a new or empty directory")
    convert.add_argument("--files", type=_positive, default=1, help="Parquet files to write")
    convert.add_argument("--row-group", type=_positive, default=10_000, help="users per row group")
    convert.add_argument(
        "--features", default=None, help="parquet/csv: uih-level columns to carry (NAME:uih,...)"
    )
    convert.add_argument(
        "--force", action="store_true", help="replace an earlier output of data convert in DST"
    )
    convert.set_defaults(run=run_convert)
    split = data_sub.add_parser(
        "split",
        help="leave-one-out split of parquet-stream data into DST/train, validation, test",
        description="Stream SRC (parquet-stream layout) row group by row group and write the "
        "leave-one-out split of the in-memory readers: DST/train (histories without their last "
        "two events), DST/validation and DST/test (one row per evaluated user, the target "
        "last). parquet-stream:DST then trains on train/ and evaluates on the other two.",
    )
    split.add_argument("src", help="a Parquet file, directory, glob or URL (parquet-stream layout)")
    split.add_argument("dst", help="a new or empty local directory")
    split.add_argument(
        "--num-items", type=_positive, default=None, help="without freescale.num_items metadata"
    )
    split.add_argument(
        "--num-actions",
        type=_positive,
        default=None,
        help="without freescale.num_actions metadata (default: 1024, 1 without actions)",
    )
    split.add_argument(
        "--force", action="store_true", help="replace an earlier output of data split in DST"
    )
    split.set_defaults(run=run_split)


def run_convert(args: argparse.Namespace) -> int:
    from freescale.data.convert import convert

    summary = convert(args.src, args.dst, args.files, args.row_group, args.features, args.force)
    print(json.dumps({"command": "data convert", "source": args.src, **summary}), flush=True)
    return 0


def run_split(args: argparse.Namespace) -> int:
    from freescale.data.split import split

    summary = split(args.src, args.dst, args.num_items, args.num_actions, args.force)
    print(json.dumps({"command": "data split", **summary}), flush=True)
    return 0
