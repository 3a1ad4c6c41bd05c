"""``freescale data stats``: sparsity, collisions and lengths of a data source."""

from __future__ import annotations

import argparse
import json
import time

from freescale.data.distributions import LengthDistribution
from freescale.data.sequences import SequenceSampling
from freescale.data.source import open_source
from freescale.data.stats import collect_stats, format_table, rows_as_dicts
from freescale.data.synthetic import SyntheticConfig

DEFAULT_MAX_UIH = "1000,2000,4000,8000,16000,21000"


def int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    data = sub.add_parser("data", help="inspect data sources")
    data_sub = data.add_subparsers(dest="data_command", required=True, metavar="COMMAND")
    stats = data_sub.add_parser(
        "stats",
        help="sparsity (paper Eq. 1), per-step collision %% and UIH length distribution",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    stats.add_argument(
        "--source", default="synthetic", help="synthetic | sasrec:PATH | movielens:PATH"
    )
    stats.add_argument(
        "--max-uih",
        type=int_list,
        default=int_list(DEFAULT_MAX_UIH),
        help="comma-separated maximum UIH lengths",
    )
    stats.add_argument(
        "--batch-size", type=int_list, default=[128], help="comma-separated local batch sizes"
    )
    stats.add_argument(
        "--world-size", type=positive_int, default=8, help="ranks forming one global batch"
    )
    stats.add_argument(
        "--steps", type=positive_int, default=8, help="consecutive global batches to measure"
    )
    stats.add_argument(
        "--shards",
        type=positive_int,
        default=None,
        help="row-wise embedding shards (default: world size)",
    )
    stats.add_argument(
        "--num-items",
        type=positive_int,
        default=SyntheticConfig.num_items,
        help="synthetic: item table rows",
    )
    stats.add_argument(
        "--zipf-alpha",
        type=float,
        default=SyntheticConfig.zipf_alpha,
        help="synthetic: Zipf exponent of item popularity",
    )
    stats.add_argument(
        "--length-median",
        type=float,
        default=LengthDistribution.median,
        help="synthetic: median raw UIH length",
    )
    stats.add_argument("--seed", type=int, default=0)
    stats.set_defaults(run=run_stats)


def run_stats(args: argparse.Namespace) -> int:
    synthetic = SyntheticConfig(
        num_items=args.num_items,
        zipf_alpha=args.zipf_alpha,
        max_uih=max(args.max_uih),
        lengths=LengthDistribution(median=args.length_median),
        seed=args.seed,
    )
    source = open_source(
        args.source, synthetic, SequenceSampling(max_uih=max(args.max_uih), seed=args.seed)
    )
    steps = args.steps
    available = source.num_steps(args.world_size, max(args.batch_size))
    if available is not None:
        if available < 2:
            raise ValueError(
                f"{args.source} holds {available} global batches of "
                f"{args.world_size}x{max(args.batch_size)}; need at least 2"
            )
        steps = min(steps, available)
    shards = args.shards or args.world_size
    start = time.perf_counter()
    rows = collect_stats(source, args.max_uih, args.batch_size, args.world_size, steps, shards)
    print(
        f"data: {args.source}  world_size={args.world_size}  shards={shards}  steps={steps}"
        f"  ({time.perf_counter() - start:.1f} s)"
    )
    print(format_table(rows))
    summary = {
        "command": "data stats",
        "source": args.source,
        "world_size": args.world_size,
        "shards": shards,
        "steps": steps,
        "rows": rows_as_dicts(rows),
    }
    print(json.dumps(summary))
    return 0
