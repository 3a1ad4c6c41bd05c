"""Quality on Beauty with a dynamic item table beside the static one (issue 61).

Two runs of one recipe (``params.preset``, `freescale.config.recipes`) on one
leave-one-out split of the SASRec file ``set.data``:

- ``static``: the file as it is; the reader remaps its ids to rows, and the
  item table has one row per item;
- ``dynamic``, once per entry of ``params.dynamic`` (``capacity_pct``, and
  optionally ``evict`` and ``admit_after``): the file with every item id sent
  through a fixed random 64-bit map (`freescale.data.ids.raw_id_map`,
  seed ``params.id_seed``; written to the raw folder), the item table dynamic
  with ``capacity_pct`` % of the items as rows, so the ids reach it raw.

Raw ids draw the same negatives as rows (catalogue positions in the same
order; tests/data/test_raw_ids.py), so both runs read the same samples and are
evaluated on the same candidates: only the table differs. Rows: the train
measure's (test HR@10 / NDCG@10, the popularity baseline, best epoch, wall s)
plus ``table``, ``items``, ``capacity``, ``evict``, ``admit_after`` and the
dynamic table's inserts, evictions, ids not admitted and last occupancy over
the steps (its step JSON lines).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from freescale.data.ids import raw_id_map

from .runner import Ctx, Result
from .scenario import Scenario, setting
from .train import run_point

DYNAMIC = ("inserts", "evictions", "not_admitted")  # summed over the steps


def hashed_copy(src: Path, dst: Path, seed: int) -> int:
    """``dst``: the SASRec file ``src`` with every item id through `raw_id_map`
    (users, lines and their order kept); the number of distinct items."""
    pairs = [line.split() for line in src.read_text().splitlines() if line.strip()]
    items = np.array([int(item) for _, item in pairs], dtype=np.int64)
    mapped = raw_id_map(items, seed).tolist()
    dst.write_text("".join(f"{user} {m}\n" for (user, _), m in zip(pairs, mapped, strict=True)))
    return int(np.unique(items).size)


def dynamic_counts(steps_file: Path) -> dict[str, Any]:
    """The dynamic table's counts summed over a run's steps, its last occupancy."""
    steps = [json.loads(x) for x in steps_file.read_text().splitlines() if x.strip()]
    steps = [x for x in steps if "dynamic_occupancy_pct" in x]
    out: dict[str, Any] = {k: sum(x[f"dynamic_{k}"] for x in steps) for k in DYNAMIC}
    out["occupancy_pct"] = steps[-1]["dynamic_occupancy_pct"] if steps else None
    return out


def measure(s: Scenario, ctx: Ctx) -> Result:
    src = Path(setting("data", s.set["data"]).partition(":")[2])  # ${FREESCALE_BEAUTY} read
    hashed = ctx.raw / f"{src.stem}-64bit{src.suffix}"
    items = hashed_copy(src, hashed, int(s.params.get("id_seed", 0)))
    cases: dict[str, dict[str, Any]] = {"static": {}}
    for variant in s.params.get("dynamic", [{"capacity_pct": 50}]):
        capacity = max(1, items * int(variant["capacity_pct"]) // 100)
        evict, admit = variant.get("evict", "lru"), int(variant.get("admit_after", 1))
        cases[f"dynamic-{variant['capacity_pct']}-{evict}-admit{admit}"] = {
            "data": f"sasrec:{hashed}", "item_capacity": capacity, "item_evict": evict,
            "item_admit_after": admit,
        }  # fmt: skip
    rows = []
    for table, sets in cases.items():
        folder = ctx.raw / table  # each run's step log apart (run_point names it by point)
        folder.mkdir(parents=True, exist_ok=True)
        row = run_point(replace(s, set={**s.set, **sets}), {"nproc": s.ranks[0]}, folder)
        row.update(table=table.partition("-")[0], items=items)
        row.update({k: sets.get(f"item_{k}") for k in ("capacity", "evict", "admit_after")})
        if sets:
            counts = dynamic_counts(folder / row["steps_file"])
            row.update({f"dynamic_{k}": v for k, v in counts.items()})
        rows.append(row)
        print(json.dumps({m: row.get(m) for m in s.metrics}, default=str), flush=True)
    sets = " ".join(f"--set {setting(k, v)}" for k, v in s.set.items())
    sections = [
        f"`dynamic`: the file's {items} item ids through a random 64-bit map, the item table "
        "dynamic with `capacity` rows (`evict`, `admit_after`); `static`: the file as it is. "
        "Same samples, same evaluated candidates.",
        "",
        f"Both: `freescale train --preset {s.params.get('preset')} {sets}` (and the "
        "dynamic run's data and capacity).",
    ]
    return Result(rows, sections)
