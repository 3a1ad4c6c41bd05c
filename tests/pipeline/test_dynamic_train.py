"""A dynamic item table in the trainer: every mode bit-identical, counts in the step JSON,
a full shard one line on every rank before anything changes.

The demo data on a small item table evicts every step from the second on; the
three modes must train the same losses, evaluate the same NE and end
with the same rows, ids and optimizer state.
"""

import pytest
import torch

from freescale.config import build_config
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks

COMMON = ["run.steps=8", "run.warmup=1", "run.batch_size=16", "output.progress=false",
          "evaluation.every=4", "evaluation.batches=1", "run.timeout_s=60"]  # fmt: skip
MODES = ("sync", "sdd", "freescale")


def _train(mode: str, capacity: int) -> dict:
    sets = [*COMMON, f"run.mode={mode}", f"embeddings.tables.item_emb.capacity={capacity}"]
    trainer = Trainer(build_config("demo", sets))
    try:
        trainer.run()
    except ValueError as e:
        return {"error": str(e), "at_step": trainer.liveness.step}
    ids, rows, state = trainer.embeddings.dynamic_rows("item_emb")
    steps = trainer.summary.steps
    return {
        "error": None,
        "losses": [s["loss"] for s in steps],
        "evals": [e["ne"] for e in trainer.summary.evals],
        "ids": ids, "rows": rows, "state": state,
        "counts": [{k: v for k, v in s.items() if k.startswith("dynamic_")} for s in steps],
    }  # fmt: skip


def _every_mode(capacity: int) -> dict:
    return {m: _train(m, capacity) for m in MODES}


@pytest.mark.parametrize(("world", "capacity"), [(1, 600), (2, 900)])
def test_every_mode_trains_a_dynamic_table_bit_identically(world, capacity):
    """(~220 distinct items a step per rank: evictions from step 2 on)"""
    runs = run_ranks(_every_mode, world, capacity, timeout=300)
    for per_mode in runs:
        want = per_mode["sync"]
        assert want["error"] is None, want["error"]
        counts = want["counts"]
        assert sum(c["dynamic_evictions"] for c in counts) > 100, counts
        assert sum(c["dynamic_inserts"] for c in counts) > 0
        assert counts[-1]["dynamic_occupancy_pct"] == 100.0
        for mode in ("sdd", "freescale"):
            got = per_mode[mode]
            assert got["losses"] == want["losses"] and got["evals"] == want["evals"], mode
            assert torch.equal(got["ids"], want["ids"]), mode
            assert torch.equal(got["rows"], want["rows"]), mode
            for k, v in want["state"].items():
                assert torch.equal(got["state"][k], v), (mode, k)


# slow: the in-process twin is tests/embedding/test_dynamic.py (1 and 2 ranks)
@pytest.mark.slow
def test_a_full_shard_stops_every_rank_with_one_line():
    runs = run_ranks(_every_mode, 2, 300, timeout=300)
    for mode in MODES:
        lines = {r[mode]["error"] for r in runs}
        assert len(lines) == 1, lines
        line = lines.pop()
        assert line is not None and "\n" not in line
        assert line.startswith("dynamic table 'item_emb' is full on rank "), line
        assert "its ids need" in line and "raise embeddings.tables.item_emb.capacity" in line
