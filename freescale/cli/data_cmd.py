"""``freescale data stats``: sparsity, collisions and lengths of a data source."""

from __future__ import annotations

import argparse
import json
import time

from freescale.cli import split_cmd
from freescale.data.distributions import LengthDistribution
from freescale.data.parquet_stream import ParquetStreamSource
from freescale.data.sequences import SequenceSampling
from freescale.data.source import open_source
from freescale.data.split_source import stream_counts
from freescale.data.stats import StreamedSamples, collect_stats, format_table, rows_as_dicts
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
        "--source",
        default="synthetic",
        help="synthetic | sasrec:PATH | movielens:PATH | parquet:PATH | csv:PATH | "
        "parquet-stream:PATH (streamed: --steps global batches, default 8)",
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
        "--steps",
        type=positive_int,
        default=None,
        help="consecutive global batches to measure (default: synthetic and streamed 8, "
        "a file all of it)",
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
    split_cmd.register(data_sub)


def run_stats(args: argparse.Namespace) -> int:
    synthetic = SyntheticConfig(
        num_items=args.num_items,
        zipf_alpha=args.zipf_alpha,
        max_uih=max(args.max_uih),
        lengths=LengthDistribution(median=args.length_median),
        seed=args.seed,
    )
    source = open_source(
        args.source,
        synthetic,
        # file data in the order training reads it (its default shuffled epochs)
        SequenceSampling(max_uih=max(args.max_uih), shuffle=True, seed=args.seed),
    )
    streamed = isinstance(source, ParquetStreamSource)  # one stream per rank
    file_data = streamed or hasattr(source, "steps_per_epoch")
    counts = stream_counts(source) if streamed else source.split_counts() if file_data else {}
    steps, coverage = {}, {}
    for b in args.batch_size:
        steps[b] = args.steps or 8
        if streamed:  # --steps global batches (default 8) of the streams training reads
            source.check_world(args.world_size, b)
            read = steps[b] * args.world_size * b
            coverage[b] = {
                "samples_read": read,
                "fraction_read": read / max(counts["train_samples"], 1),
            }
        elif file_data:  # one pass over the training samples, or less if --steps says so
            available = source.steps_per_epoch(args.world_size, b)
            if available < 2:
                raise ValueError(
                    f"{args.source} holds {len(source)} training samples = {available} global "
                    f"batches of --world-size {args.world_size} x --batch-size {b}; need at "
                    "least 2: give a smaller --batch-size or --world-size"
                )
            steps[b] = min(args.steps or available, available)
            read = steps[b] * args.world_size * b
            coverage[b] = {"samples_read": read, "fraction_read": read / len(source)}
    shards = args.shards or args.world_size
    start = time.perf_counter()
    if streamed:
        rows = []
        for b in args.batch_size:
            numbered = StreamedSamples(source, args.world_size, b)
            rows += collect_stats(numbered, args.max_uih, [b], args.world_size, steps, shards)
    else:
        rows = collect_stats(source, args.max_uih, args.batch_size, args.world_size, steps, shards)
    print(
        f"data: {args.source}  world_size={args.world_size}  shards={shards}"
        f"  ({time.perf_counter() - start:.1f} s)"
    )
    summary = {
        "command": "data stats",
        "source": args.source,
        "world_size": args.world_size,
        "shards": shards,
        "steps": {str(b): n for b, n in steps.items()},
        "rows": rows_as_dicts(rows),
    }
    if file_data:
        print(
            f"users: {counts['users']}, {counts['users_dropped']} dropped as too short; "
            f"{counts['train_samples']} training samples (leave-one-out split: the last two "
            f"interactions of each user are held out)"
        )
        total = counts["train_samples"]
        for b, c in coverage.items():
            if streamed:
                why = f": {steps[b]} global batches (--steps) of the ranks' streams"
            else:
                why = "" if c["fraction_read"] == 1 else ": the rest does not fill a global batch"
            print(
                f"batch {b}: read {c['samples_read']} of {total} training samples "
                f"({100 * c['fraction_read']:.2f}%){why}"
            )
        summary.update(split=counts, coverage={str(b): c for b, c in coverage.items()})
    print(format_table(rows))
    print(json.dumps(summary))
    return 0
