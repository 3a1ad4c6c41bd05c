"""Side-by-side step times of two builds on one GPU, alternating base, new, base, ...

    git archive 7f5f77f freescale | tar x -C .base     # the older build's package
    python3 scripts/ab_builds.py --base .base --out DIR [--rounds 2]

Each run is a fresh ``python -m freescale.cli.main train`` of one build (its
tree first on ``PYTHONPATH``) with the same flat ``--set`` keys, which every
build since the CLI began accepts; the step time is the run summary's
``step_ms`` (mean of the steps after warm-up). Points: ``h200-21k`` batch 128
eager and UIH 2k batch 32 with CUDA graphs, mode sync, one rank. Prints one
line per run and a table of medians; writes ``ab-builds.md`` / ``.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

POINTS = (
    ("21k b128 eager", ["max_uih=21000", "batch_size=128", "dense_graphs=false"]),
    ("2k b32 graphs", ["max_uih=2000", "batch_size=32", "dense_graphs=true"]),
)
COMMON = ["nproc=1", "mode=sync", "steps=40", "warmup=20", "eval_every=0", "progress=false"]


def step_ms(tree: Path, keys: list[str], log: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve()), "PYTHONUNBUFFERED": "1"}
    sets = [a for k in [*COMMON, *keys] for a in ("--set", k)]
    cmd = [sys.executable, "-m", "freescale.cli.main", "train", "--preset", "h200-21k", *sets]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=280)
    log.write_text(done.stdout + done.stderr)
    if done.returncode:
        raise SystemExit(f"{tree}: rc {done.returncode}; see {log}")
    summary = next(json.loads(x) for x in reversed(done.stdout.splitlines()) if x.startswith("{"))
    return float(summary["step_ms"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, required=True, help="the older build's tree")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    trees = {"base": args.base, "new": Path(".")}
    rows = []
    with open(args.out / "ab-builds.jsonl", "w") as jl:
        for r in range(args.rounds):
            for name, keys in POINTS:
                for build, tree in trees.items():
                    log = args.out / f"{build}-{name.replace(' ', '-')}-r{r}.log"
                    row = {"build": build, "point": name, "round": r}
                    row["step_ms"] = step_ms(tree, keys, log)
                    print(json.dumps(row), flush=True)
                    jl.write(json.dumps(row) + "\n")
                    rows.append(row)
    lines = ["| point | base ms (median) | new ms (median) | new / base |", "|---|---|---|---|"]
    for name, _ in POINTS:
        got = {
            b: [x["step_ms"] for x in rows if (x["build"], x["point"]) == (b, name)] for b in trees
        }
        a, b = statistics.median(got["base"]), statistics.median(got["new"])
        lines.append(f"| {name} | {a:.2f} {got['base']} | {b:.2f} {got['new']} | {b / a:.4f} |")
    (args.out / "ab-builds.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
