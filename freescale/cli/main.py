"""The ``freescale`` command."""

from __future__ import annotations

import argparse
import os
import sys

from freescale.cli import (
    calibrate_cmd,
    data_cmd,
    eval_cmd,
    export_cmd,
    report_cmd,
    simulate_cmd,
    trace_cmd,
    train_cmd,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="freescale",
        description="Bubble-free distributed training of sequence recommendation models.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train_cmd.register(sub)
    eval_cmd.register(sub)
    export_cmd.register(sub)
    data_cmd.register(sub)
    report_cmd.register(sub)
    trace_cmd.register(sub)
    simulate_cmd.register(sub)
    calibrate_cmd.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ValueError as e:  # user errors: one clear line, no traceback
        print(f"freescale: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `freescale ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second one at exit
        return 0
    except RuntimeError as e:
        stopped = getattr(e, "exit_code", None)  # RunStopped: SIGTERM 143, SIGINT 130
        if stopped is not None:
            print(f"freescale: {e}", file=sys.stderr)
            return stopped
        if type(e).__name__ != "RunFailed":  # a rank failed: its one line (trace printed above)
            raise
        print(f"freescale: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # SIGINT before any rank started
        print("freescale: stopped by SIGINT", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
