"""``python -m benchmarks``: list, plan, run, session, index (see __init__)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import report, runner
from .scenario import load, names, plan


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="every scenario: figure or guard, device, ranks, title")
    pl = sub.add_parser("plan", help="which scenarios a machine of N GPUs can run")
    pl.add_argument("--gpus", type=int, required=True)
    r = sub.add_parser("run", help="run one scenario and write its report")
    r.add_argument("scenario")
    r.add_argument("--smoke", action="store_true", help="seconds on the CPU; not a result")
    r.add_argument("--out", type=Path, default=None, help="report folder (default results/)")
    r.add_argument("--ranks", default="", help="only these of its world sizes, e.g. 2,4")
    se = sub.add_parser("session", help="run several scenarios, pack their raw logs once")
    se.add_argument("scenarios", nargs="*", help="default: every one `plan --gpus` allows")
    se.add_argument("--gpus", type=int, default=0)
    se.add_argument("--smoke", action="store_true")
    se.add_argument("--out", type=Path, required=True)
    ix = sub.add_parser("index", help="rewrite results/INDEX.md from the reports")
    ix.add_argument("--results", type=Path, default=report.RESULTS)
    args = p.parse_args(argv)
    if args.cmd == "list":
        for n in names():
            s = load(n)
            print(f"{n:18s} {s.label:22s} {s.device:4s} ranks {s.ranks!s:10s} {s.title}")
    elif args.cmd == "plan":
        for s, ok, why in plan(args.gpus):
            print(f"{'yes' if ok else 'no ':3s}  {s.name:18s} {s.label:22s} {why}")
    elif args.cmd == "run":
        ranks = [int(x) for x in args.ranks.split(",")] if args.ranks else None
        return runner.run(args.scenario, args.smoke, args.out, ranks=ranks)
    elif args.cmd == "session":
        chosen = args.scenarios or [s.name for s, ok, _ in plan(args.gpus) if ok]
        return runner.session(chosen, args.out, args.smoke, None if args.smoke else args.gpus)
    elif args.cmd == "index":
        scenarios = [load(n) for n in names()]
        (args.results / "INDEX.md").write_text(report.index(args.results, scenarios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
