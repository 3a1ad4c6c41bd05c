"""The Beauty table: three models against the popularity baseline, one split.

Trains, on the CPU with 2 gloo ranks in ``sync`` mode, through the CLI:

- ``reference``: the built-in sequence model (the default model);
- ``hstu``: the built-in HSTU (``freescale.models.hstu:build``);
- ``categories``: the example model (``examples/categories.py``) from a
  Parquet file with a hashed ``categories`` column, written from the same
  SASRec file by ``python -m examples.categories`` (same users, items and
  order, so the same leave-one-out split and the same sampled negatives);

then reads each run's JSON summary (test HR@10 / NDCG@10, and the
popularity baseline the summary prints) and writes
``benchmarks/results/beauty-table.md`` and ``.json``.

    .venv/bin/python scripts/beauty_table.py --data PATH/beauty.txt   # or FREESCALE_BEAUTY=PATH

``--attention fused,padded --seeds 0,1`` trains HSTU alone instead, once per
attention and seed (``model.attention``, ``run.seed``), and checks that each
attention's test HR@10 / NDCG@10 lies within the spread of the last one's two
seeds (the fused kernel must change speed, not quality; the rule is in
`spread_verdicts`). ``--gpu`` runs on one GPU (``run.device=cuda``,
``run.nproc=1``, batch 128: the samples per step of 2 ranks x 64) through
``python -m freescale.cli.main``, for machines without the ``.venv``::

    python scripts/beauty_table.py --gpu --attention fused,padded --seeds 0,1 \
        --hstu-dim 64 --data .data/beauty.txt --out benchmarks/results/hstu-beauty

Each run logs to ``--logs`` (default ``/tmp/beauty-table``); ``--reuse``
takes a run's summary from its log when the log's first line is the same
command (so runs started separately are not repeated).  The config keys are
all in `KEYS` below: one place to follow a rename of the configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CLI = [".venv/bin/freescale", "train"]

# Config keys (flat form; docs/train-on-your-data.md). Only here.
KEYS = {
    "data": "data",
    "features": "data.features",
    "mode": "run.mode",
    "nproc": "run.nproc",
    "device": "run.device",
    "steps": "run.steps",
    "batch_size": "run.batch_size",
    "samples_per_user": "data.samples_per_user",
    "max_uih": "data.max_uih",
    "eval_every": "evaluation.every",
    "progress": "output.progress",
    "seed": "run.seed",
    "model": "model",
    "attention": "model.attention",
    "hstu_dim": "model.dim",
}

COMMON = {
    "mode": "sync",
    "nproc": 2,
    "device": "cpu",
    "steps": 3000,
    "batch_size": 64,
    "samples_per_user": 0,
    "max_uih": 50,
    "eval_every": 0,
    "progress": "false",
    "seed": 0,
}
N_CATEGORIES = 64
GPU = {"device": "cuda", "nproc": 1, "batch_size": 128}  # --gpu: one GPU, the same samples per step


def settings(
    name: str, data: Path, parquet: Path, gpu: bool = False, hstu_dim: int = 32
) -> list[tuple[str, object]]:
    """(key, value) pairs of run ``name`` (``hstu-ATTENTION-sSEED`` for the
    attention runs); model options are ``model.KEY``."""
    sasrec = [(KEYS["data"], f"sasrec:{data}")]
    values = {**COMMON, **(GPU if gpu else {})}
    hstu = [(KEYS["model"], "freescale.models.hstu:build"), (KEYS["hstu_dim"], hstu_dim)]
    if name.startswith("hstu-"):
        attention, seed = name.removeprefix("hstu-").rsplit("-s", 1)
        values["seed"] = int(seed)
        hstu.append((KEYS["attention"], attention))
    common = [(KEYS[k], v) for k, v in values.items()]
    if name == "reference":
        return sasrec + common
    if name == "hstu" or name.startswith("hstu-"):
        return sasrec + common + hstu
    if name == "categories":
        return [
            (KEYS["data"], f"parquet:{parquet}"),
            (KEYS["features"], "categories:uih,categories:candidates"),
            *common,
            (KEYS["model"], "examples.categories:build"),
            ("model.category", "categories"),
            ("model.dim", 32),
        ]
    raise ValueError(name)


MODELS = ("reference", "hstu", "categories")


def command(pairs: list[tuple[str, object]], gpu: bool = False) -> list[str]:
    module = gpu or not (ROOT / CLI[0]).exists()  # no .venv here: this interpreter's freescale
    out = [sys.executable, "-m", "freescale.cli.main", "train"] if module else list(CLI)
    for k, v in pairs:
        out += ["--set", f"{k}={v}"]
    return out


def summary_of(log: Path, cmd: str) -> dict | None:
    """The JSON summary in ``log`` if it ran ``cmd`` to the end."""
    if not log.exists():
        return None
    lines = log.read_text().splitlines()
    if not lines or lines[0] != cmd:
        return None
    for line in reversed(lines):
        if line.startswith("{") and '"eval"' in line:
            return json.loads(line)
    return None


def run(name: str, argv: list[str], logs: Path, reuse: bool) -> tuple[dict, float | None]:
    cmd = shlex.join(argv)
    log = logs / f"{name}.log"
    if reuse and (found := summary_of(log, cmd)) is not None:
        print(f"{name}: summary from {log}", flush=True)
        return found, None
    print(f"{name}: {cmd}  (log: {log})", flush=True)
    start = time.time()
    with log.open("w") as f:
        f.write(cmd + "\n")
        f.flush()
        proc = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    wall = time.time() - start
    found = summary_of(log, cmd)
    if proc.returncode != 0 or found is None:
        sys.exit(f"{name} failed (rc {proc.returncode}); see {log}")
    with log.open("a") as f:
        f.write(f"# wall_s {wall:.0f}\n")
    return found, wall


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True).stdout.strip()  # fmt: skip
    return out.stdout.decode().strip() + ("-dirty" if dirty else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    beauty = os.environ.get("FREESCALE_BEAUTY")
    ap.add_argument("--data", type=Path, default=Path(beauty) if beauty else None,
                    help="the Amazon Beauty SASRec file (default: $FREESCALE_BEAUTY)")  # fmt: skip
    ap.add_argument("--logs", type=Path, default=Path("/tmp/beauty-table"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/beauty-table")
    ap.add_argument("--only", default=",".join(MODELS), help="comma-separated models")
    ap.add_argument("--reuse", action="store_true", help="take summaries from matching logs")
    ap.add_argument("--attention", default="", help="HSTU only: these model.attention values")
    ap.add_argument("--seeds", default="0", help="with --attention: comma-separated run.seed")
    ap.add_argument("--hstu-dim", type=int, default=32, help="HSTU model.dim")
    ap.add_argument("--gpu", action="store_true", help="one GPU, python -m freescale.cli.main")
    ap.add_argument("--steps", type=int, default=COMMON["steps"], help="training steps per run")
    args = ap.parse_args()
    if args.data is None or not args.data.is_file():
        ap.error(f"--data {args.data}: not a file (the Beauty SASRec file, or FREESCALE_BEAUTY)")
    COMMON["steps"] = args.steps
    args.logs.mkdir(parents=True, exist_ok=True)
    commit = git_commit()  # the code the runs use (taken before they start)
    data = args.data.resolve()
    parquet = args.logs / "beauty-categories.parquet"
    only = args.only.split(",")
    if args.attention:
        seeds = args.seeds.split(",")
        only = [f"hstu-{a}-s{s}" for a in args.attention.split(",") for s in seeds]
    commands: list[str] = []
    if "categories" in only:
        prep = [sys.executable, "-m", "examples.categories", str(data), str(parquet),
                str(N_CATEGORIES)]  # fmt: skip
        prep[0] = ".venv/bin/python"
        commands.append(shlex.join(prep))
        if not (args.reuse and parquet.exists()):
            subprocess.run(prep, cwd=ROOT, check=True)
    rows, popularity, counts = {}, None, None
    for name in only:
        argv = command(settings(name, data, parquet, args.gpu, args.hstu_dim), args.gpu)
        commands.append(shlex.join(argv))
        summary, wall = run(name, argv, args.logs, args.reuse)
        ev = summary["eval"]
        rows[name] = {"test": ev["test"], "valid": ev["valid"], "wall_s": wall}
        if popularity is None:
            popularity, counts = ev["popularity_test"], ev["data"]
        elif ev["popularity_test"] != popularity or ev["data"] != counts:
            sys.exit(f"{name}: not the same split or negatives: {ev['popularity_test']} "
                     f"!= {popularity}")  # fmt: skip
    report(args.out, rows, popularity, counts, commands, data, commit, args.gpu)


def spread_verdicts(rows: dict, n_users: int) -> list[dict]:
    """Each attention's seeds against the last attention's two (the reference path).

    For metric M and seed s: within the spread when |M(a, s) - M(ref, s)| <=
    |M(ref, s1) - M(ref, s0)| + 2·sqrt(m(1 - m)/n), m the reference's mean and n
    the evaluated users: the two reference seeds' gap plus twice a bound on one
    run's standard error (per-user HR and NDCG lie in [0, 1], so their variance is
    at most m(1 - m)). Run names are ``hstu-ATTENTION-sSEED``."""
    runs = {tuple(n.removeprefix("hstu-").rsplit("-s", 1)): r for n, r in rows.items()}
    attentions = list(dict.fromkeys(a for a, _ in runs))
    seeds = list(dict.fromkeys(s for _, s in runs))
    if len(attentions) < 2 or len(seeds) < 2:
        return []
    ref, out = attentions[-1], []
    for metric in ("hr@10", "ndcg@10"):
        base = [runs[(ref, s)]["test"][metric] for s in seeds[:2]]
        m = sum(base) / 2
        margin = 2 * (m * (1 - m) / max(n_users, 1)) ** 0.5
        for a in attentions[:-1]:
            for s in seeds:
                gap = abs(runs[(a, s)]["test"][metric] - runs[(ref, s)]["test"][metric])
                out.append({"attention": a, "seed": s, "metric": metric, "gap": gap,
                            "spread": abs(base[1] - base[0]), "margin": margin,
                            "within": gap <= abs(base[1] - base[0]) + margin})  # fmt: skip
    return out


def report(out: Path, rows, popularity, counts, commands, data: Path, commit: str,
           gpu: bool = False) -> None:  # fmt: skip
    import torch

    where = (f"{torch.cuda.get_device_name(0)} (one GPU)" if gpu and torch.cuda.is_available()
             else "CPU run, 2 gloo ranks")  # fmt: skip
    head = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{cpu_model()}, {os.cpu_count()} CPUs visible, shared with other jobs "
        f"({where})",
        "torch": torch.__version__,
        "commit": commit,
        "data": str(data),
    }
    beats = {
        n: r["test"]["hr@10"] > popularity["hr@10"] and r["test"]["ndcg@10"] > popularity["ndcg@10"]
        for n, r in rows.items()
    }
    hstu_only = all(n.startswith("hstu-") for n in rows)
    title = "HSTU attentions and seeds" if hstu_only else "three models"
    lines = [
        f"# Beauty: {title} against the popularity baseline",
        "",
        *(f"- {k}: {v}" for k, v in head.items()),
        f"- users: {counts['users']}, evaluated: {counts['eval_users']}, training samples: "
        f"{counts['train_samples']}, dropped: {counts['users_dropped']}",
        "- split: leave-one-out; test = each user's last item against 100 sampled "
        "negatives (the same for every run: the popularity row is identical in all)",
        "",
        "| model | test HR@10 | test NDCG@10 | valid HR@10 | valid NDCG@10 | beats popularity "
        "| wall s |",
        "|---|---|---|---|---|---|---|",
        f"| popularity | {popularity['hr@10']:.4f} | {popularity['ndcg@10']:.4f} | | | | |",
    ]
    for n, r in rows.items():
        t, v = r["test"], r["valid"]
        wall = "" if r["wall_s"] is None else f"{r['wall_s']:.0f}"
        lines.append(
            f"| {n} | {t['hr@10']:.4f} | {t['ndcg@10']:.4f} | {v['hr@10']:.4f} | "
            f"{v['ndcg@10']:.4f} | {'yes' if beats[n] else 'NO'} | {wall} |"
        )
    verdicts = spread_verdicts(rows, counts["eval_users"]) if hstu_only else []
    if verdicts:
        lines += ["", "Within the spread of the last attention's two seeds (test; |a − ref| "
                  "at the same seed ≤ |ref s1 − ref s0| + 2·sqrt(m(1 − m)/users)):", "",
                  "| attention | seed | metric | gap | seed spread | margin | within |",
                  "|---|---|---|---|---|---|---|"]  # fmt: skip
        lines += [f"| {v['attention']} | {v['seed']} | {v['metric']} | {v['gap']:.4f} | "
                  f"{v['spread']:.4f} | {v['margin']:.4f} | {'yes' if v['within'] else 'NO'} |"
                  for v in verdicts]  # fmt: skip
    lines += ["", "Commands (from the repository root):", "", "```bash", *commands, "```", ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text("\n".join(lines))
    record = {**head, "split": counts, "popularity_test": popularity, "runs": rows,
              "beats_popularity": beats, "commands": commands,
              "within_spread": verdicts}  # fmt: skip
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print("\n".join(lines))
    print(json.dumps({"beats_popularity": beats}))


if __name__ == "__main__":
    main()
