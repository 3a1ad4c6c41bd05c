"""Measure: step times of this checkout beside an older build, alternating runs.

The older build is a tree holding its ``freescale`` package, made with
``git archive COMMIT freescale | tar x -C .base``. Each run is a fresh
``python -m freescale.cli.main train`` of one build (run in its tree, which
is also first on ``PYTHONPATH``) with the same ``section.key`` ``--set`` keys,
which every build since the config had sections (53f02fb) accepts; a run's
step time is its summary's ``step_ms`` (mean after warm-up). Runs alternate
base, new, base, new, ... so drift on the machine falls on both builds alike.

Parameters (``[params]``): ``base`` (the older tree), ``rounds``, ``preset``,
``common`` (``--set`` keys of every run), ``points`` (label -> keys of that
point), ``timeout`` (seconds per run).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

from . import report
from .runner import Ctx, Result
from .scenario import Scenario

DEFAULTS = {"base": ".base", "rounds": 2, "preset": "h200-21k", "common": [], "points": {},
            "timeout": 280}  # fmt: skip


def step_ms(tree: Path, preset: str, keys: list[str], log: Path, timeout: float) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "PYTHONUNBUFFERED": "1"}
    sets = [a for k in keys for a in ("--set", k)]
    cmd = [sys.executable, "-m", "freescale.cli.main", "train", "--preset", preset, *sets]
    # In the tree: ``-m`` puts the working directory first on sys.path, and
    # from this checkout's root that would shadow the base tree's package.
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, timeout=timeout)
    log.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise RuntimeError(f"{tree}: rc {done.returncode}; see {log}")
    summary = next(json.loads(x) for x in reversed(done.stdout.splitlines()) if x.startswith("{"))
    return float(summary["step_ms"])


def measure(s: Scenario, ctx: Ctx) -> Result:
    args = SimpleNamespace(**{**DEFAULTS, **s.params})
    trees = {"base": report.ROOT / args.base, "new": report.ROOT}
    if not (trees["base"] / "freescale").is_dir():
        raise FileNotFoundError(f"{trees['base']}: no freescale package (see benchmarks/ab.py)")
    times: dict[tuple[str, str], list[float]] = defaultdict(list)  # (point, build) -> ms
    for r in range(args.rounds):
        for point, keys in args.points.items():
            for build, tree in trees.items():
                log = ctx.raw / f"{build}-{point.replace(' ', '-')}-r{r}.log"
                ms = step_ms(tree, args.preset, [*args.common, *keys], log, args.timeout)
                times[point, build].append(ms)
                run = {"build": build, "point": point, "round": r, "step_ms": ms}
                print(json.dumps(run), flush=True)
    rows = []
    for point in args.points:
        base, new = times[point, "base"], times[point, "new"]
        ratio = statistics.median(new) / statistics.median(base)
        rows.append({"case": point, "base_ms": statistics.median(base),
                     "new_ms": statistics.median(new), "new_vs_base": ratio,
                     "base_runs": base, "new_runs": new})  # fmt: skip
    note = (
        f"base: the tree at `{args.base}`; new: this checkout. Medians over {args.rounds} round(s)."
    )
    return Result(rows, [note])
