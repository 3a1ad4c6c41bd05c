"""``freescale trace``: GPU bubbles in a ``torch.profiler`` Chrome trace."""

from __future__ import annotations

import argparse
import dataclasses
import json

from freescale.observe.trace import (
    format_summary,
    format_threads,
    gpu_gaps,
    load_trace,
    thread_ops,
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="GPU idle gaps in a profiler trace (and the CPU during them)")
    p.add_argument(
        "trace", help="Chrome trace (.json or .json.gz) from --set output.trace_path=..."
    )
    p.add_argument("--min-gap-us", type=float, default=50.0, help="smallest gap listed (µs)")
    p.add_argument("--min-wait-us", type=float, default=1000.0, help="shortest host wait (µs)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    p.add_argument(
        "--threads", type=int, default=0, metavar="N",
        help="also each host thread's N longest outermost ops per profiled step",
    )  # fmt: skip
    p.set_defaults(run=run_trace)


def run_trace(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    summary = gpu_gaps(trace, args.min_gap_us, args.min_wait_us)
    if args.json:
        print(json.dumps(dataclasses.asdict(summary)))
    else:
        print(format_summary(summary), end="")
        if args.threads:
            print(format_threads(thread_ops(trace), args.threads), end="")
    return 0
