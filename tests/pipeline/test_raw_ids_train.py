"""Training on raw 64-bit item ids: a dynamic item table trains on a tiny
Beauty-like file (the sasrec-sequence recipe, shrunk) and reports held-out
HR@10 / NDCG@10; a static table given such ids is one line, before any step."""

from __future__ import annotations

import math

import numpy as np
import pytest

import freescale
from freescale.config import build_config
from freescale.data.ids import raw_id_map

ITEMS = 500


def write_beauty_like(path, users: int = 80, seed: int = 0) -> set[int]:
    """SASRec lines ``user item`` (5 to 12 items a user, half of them from a
    popular head), item ids sent through the 64-bit map; the set of ids written.
    Half the items hold two calls' ids (4 samples x (8 + 1 + 4) ids each): the
    table fits them while it evicts."""
    rng = np.random.default_rng(seed)
    lines, written = [], set()
    for u in range(1, users + 1):
        n = int(rng.integers(5, 13))
        head = rng.random(n) < 0.5  # half from 20 popular items, half from the rest
        items = np.where(head, rng.integers(1, 21, n), rng.integers(21, ITEMS, n))
        for item in raw_id_map(items.astype(np.int64), seed=11).tolist():
            lines.append(f"{u} {item}\n")
            written.add(item)
    path.write_text("".join(lines))
    return written


def recipe(path, *settings: str):
    """The sasrec-sequence recipe at a test's size: one epoch of one target per user,
    CPU, one rank, evaluated at the end only."""
    return build_config("sasrec-sequence", [
        "run.device=cpu", "run.nproc=1", "run.epochs=1", "run.batch_size=4", "run.warmup=1",
        f"data=sasrec:{path}", "data.max_uih=8", "data.train_negatives=4",
        "data.eval_negatives=20", "data.samples_per_user=1", "data.loader_workers=0",
        "model.dim=16", "dense.lr_warmup=1", "output.progress=false",
        "evaluation.keep_best=", "evaluation.patience=0", "evaluation.every_epochs=0",
        *settings,
    ])  # fmt: skip


def test_a_dynamic_table_trains_on_64_bit_ids_and_reports_hr_and_ndcg(tmp_path):
    ids = write_beauty_like(tmp_path / "beauty64.txt")
    capacity = len(ids) // 2
    cfg = recipe(tmp_path / "beauty64.txt", f"embeddings.tables.item_emb.capacity={capacity}")
    result = freescale.train(config=cfg)
    final = result.summary["eval"]
    for split in ("valid", "test"):
        for metric in ("hr@10", "ndcg@10"):
            value = final[split][metric]
            assert math.isfinite(value) and 0.0 <= value <= 1.0
    assert final["test"]["users"] == 80
    assert sum(s["dynamic_inserts"] for s in result.steps) >= capacity  # the table filled ...
    assert sum(s["dynamic_evictions"] for s in result.steps) > 0  # ... and evicted


def test_a_static_table_given_raw_ids_is_one_line(tmp_path):
    write_beauty_like(tmp_path / "beauty64.txt", users=20)
    cfg = recipe(tmp_path / "beauty64.txt", "data.raw_ids=on")
    static = r"table 'item_emb' .*looked up id -?\d+, outside its rows"
    with pytest.raises(ValueError, match=static):
        freescale.train(config=cfg)
