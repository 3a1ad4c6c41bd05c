"""GPU time of the prioritized schedule's own work per step: the collision split and the merge.

Two consecutive global steps of a preset's synthetic data (world size 1: one
shard holds every row) give the slots the owner sees. Timed with CUDA events
(median): `owner_marks` (sort + binary search, no host read) next to its
``torch.unique`` twin, and `fill_marked` (forward's merge of the updated
collision rows into the prefetched ones) on ``[ids, dim]`` bf16 rows. Compare
with the step time of the same preset (``--step-ms``, from data_wait.py).

    python benchmarks/collision.py --preset h200-21k --batch 128 --step-ms 179.2
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import torch

from freescale.embedding.collision_link import fill_marked, owner_marks, owner_marks_reference
from freescale.pipeline.config import build_config
from freescale.pipeline.setup import make_source

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interference import time_ms


def step_ids(source, step: int, batch: int) -> torch.Tensor:
    b = source.batch(step, 0, 1, batch)
    feats = [b.uih["item_ids"], b.candidates["item_ids"], b.content["content_ids"]]
    return torch.cat(feats).cuda()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="h200-21k")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--step-ms", type=float, default=None)
    p.add_argument("--out", default=f"benchmarks/results/collision-{date.today()}")
    args = p.parse_args()
    source = make_source(build_config(args.preset, ["device=cpu"]))
    now, nxt = step_ids(source, 0, args.batch), step_ids(source, 1, args.batch)
    marks_now, marks_next, stats = owner_marks(now, nxt)
    ref = owner_marks_reference(now, nxt)
    same = all(torch.equal(a, b) for a, b in zip((marks_now, marks_next, stats), ref, strict=True))
    rows = torch.randn(nxt.numel(), args.dim, device="cuda", dtype=torch.bfloat16)
    collided = torch.randn(int(marks_next.sum()), args.dim, device="cuda", dtype=torch.bfloat16)
    times = {
        "owner_marks (sort + search)": time_ms(lambda: owner_marks(now, nxt), 30),
        "owner_marks_reference (torch.unique)": time_ms(
            lambda: owner_marks_reference(now, nxt), 30
        ),
        "fill_marked (merge)": time_ms(lambda: fill_marked(marks_next, collided, rows), 30),
    }
    rows_pct = 100.0 * float(stats[0]) / max(float(stats[1]), 1.0)
    ids_pct = 100.0 * float(stats[2]) / max(float(stats[3]), 1.0)
    lines = [
        "# Collision split and merge: GPU time per step", "",
        f"- date: {date.today()}",
        f"- machine: {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- data: {args.preset}, batch {args.batch}, world size 1: {now.numel()} and "
        f"{nxt.numel()} ids; collision {rows_pct:.1f}% of rows, {ids_pct:.1f}% of ids; "
        f"fast marks equal the twin's: {same}", "",
        "| op | GPU ms | % of step |", "|---|---|---|",
    ]  # fmt: skip
    for name, ms in times.items():
        share = f"{100 * ms / args.step_ms:.2f}" if args.step_ms else "–"
        lines.append(f"| {name} | {ms:.3f} | {share} |")
    Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({"benchmark": "collision", "times_ms": times, "same_as_twin": same}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
