"""A model table smaller than the data's ids is one line on every rank, before any update.

The loader checks ids against the data's sizes; the tables a model declares
may be smaller (a hard-coded size). Each training batch is also checked
against the rows of the table each lookup feature hits, so an item table of
100 rows on data of 2000 items is rc 2 and one line naming the table, never
lookups that reach the next table of the store (tests/pipeline/_two_tables.py
keeps its item and content tables in one store, end to end).
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from freescale.config import build_config
from freescale.data import SyntheticConfig, SyntheticSource
from freescale.jagged.batch import UIH_IDS
from freescale.pipeline.evaluator import EVAL_STEP_OFFSET
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks
from tests.pipeline._two_tables import build

ROOT = Path(__file__).resolve().parents[2]
TABLES = ("items", "content")
BAD_RANK, BAD_STEP, BAD_ID, ITEM_ROWS, NUM_ITEMS = 1, 3, 150, 100, 2000
HINT = (
    "the model's table is smaller than the ids its embedding_inputs gives it "
    "(size tables from the schema the factory gets, e.g. schema.num_items)"
)
COMMON = ["run.steps=6", "run.warmup=1", "run.batch_size=8", "output.progress=false",
          "run.timeout_s=60", "pipeline.prioritize=on"]  # fmt: skip


def _cli(world: int, mode: str) -> subprocess.CompletedProcess:
    args = ["model=tests.pipeline._two_tables:build", f"model.item_rows={ITEM_ROWS}",
            f"run.nproc={world}", f"run.mode={mode}", "run.steps=3", "run.warmup=1",
            "run.batch_size=8", "evaluation.every=0", "output.progress=false"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    sets = [a for x in args for a in ("--set", x)]
    return subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", "train", *sets],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


# Every mode at 1 and 2 ranks; the CLI's cost (a launch each) keeps one in the
# default suite (the in-process test below covers every mode and world there).
CLI_CASES = [
    (1, "sync"),
    *(pytest.param(w, m, marks=pytest.mark.slow)
      for w, m in [(1, "sdd"), (1, "freescale"), (2, "sync"), (2, "sdd"), (2, "freescale")]),
]  # fmt: skip


@pytest.mark.parametrize(("world", "mode"), CLI_CASES)
def test_an_undersized_table_is_one_line_and_status_2(world, mode):
    """The demo data (2000 items) on an item table of 100 rows, from the CLI."""
    proc = _cli(world, mode)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip()
    assert "\n" not in err, err
    assert err.startswith("freescale: error: bad input on rank "), err
    assert "step 0" in err and "table 'items' (feature 'items')" in err, err
    assert f"outside its rows [0, {ITEM_ROWS}): {HINT}" in err, err


class SmallIds:
    """Data declaring 2000 items whose ids stay below 100, but for one id:
    ``BAD_ID`` in rank 1's batch of ``BAD_STEP`` (``train``) or of the first
    held-out batch (``eval``)."""

    def __init__(self, where: str) -> None:
        self.source = SyntheticSource(SyntheticConfig(num_items=ITEM_ROWS, max_uih=16, seed=3))
        self.where, self.num_items, self.num_actions = where, NUM_ITEMS, self.source.num_actions

    def batch(self, step, rank, world_size, batch_size):
        b = self.source.batch(step, rank, world_size, batch_size)
        bad_step = BAD_STEP if self.where == "train" else EVAL_STEP_OFFSET
        if (step, rank) == (bad_step, min(BAD_RANK, world_size - 1)):
            b.uih.features[UIH_IDS][-1] = BAD_ID
        return b

    def num_steps(self, world_size, batch_size):
        return None


def _model(schema):
    return build(schema, item_rows=ITEM_ROWS)


def _snapshot(trainer: Trainer) -> dict:
    emb = trainer.embeddings
    return {
        "tables": {t: emb.full_table(t) for t in TABLES},
        "state": {t: emb.full_optimizer_state(t) for t in TABLES},
        "steps": {t: emb.step_of(t) for t in TABLES},
        "dense": {k: v.detach().clone() for k, v in trainer.dense_state_dict().items()},
    }


def _bad_then_clean(mode: str) -> dict:
    cfg = build_config("demo", [*COMMON, f"run.mode={mode}", "evaluation.every=0"])
    trainer = Trainer(cfg, model=_model, data=SmallIds("train"))
    assert len(trainer.embeddings.stores) == 1  # the two tables share one store, end to end
    start = time.perf_counter()
    try:
        trainer.run()
        return {"error": None}
    except ValueError as e:
        error, seconds, at = str(e), time.perf_counter() - start, trainer.liveness.step
    out = {"error": error, "seconds": seconds, "at_step": at, **_snapshot(trainer)}
    # the same run stopped before the bad batch's step: what nothing-updated means
    steps = [*COMMON, f"run.mode={mode}", "evaluation.every=0", f"run.steps={at}", "run.warmup=0"]
    clean = Trainer(build_config("demo", steps), model=_model, data=SmallIds("none"))
    clean.run()
    return {**out, "clean": _snapshot(clean)}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("mode", ["sync", "sdd", "freescale"])
def test_an_id_beyond_its_table_updates_nothing(world, mode):
    """Ids reach the next table of the store at slot ``BAD_ID`` at one rank: the
    batch is refused when taken, every table, optimizer state and dense weight
    as the run left them before it."""
    results = run_ranks(_bad_then_clean, world, mode, timeout=240)
    errors = [r["error"] for r in results]
    assert errors[0] is not None and len(set(errors)) == 1, errors
    rank = min(BAD_RANK, world - 1)
    assert errors[0] == (
        f"bad input on rank {rank}, step {BAD_STEP}: table 'items' (feature 'items') looked up "
        f"id {BAD_ID}, outside its rows [0, {ITEM_ROWS}): {HINT}"
    ), errors[0]
    for r in results:
        assert r["seconds"] < 30  # not the timeout
        for key in ("tables", "state"):
            for t in TABLES:
                got, want = r[key][t], r["clean"][key][t]
                if key == "tables":
                    assert torch.equal(got, want), (key, t)
                else:
                    for k in want:
                        assert torch.equal(got[k], want[k]), (key, t, k)
        assert r["steps"] == r["clean"]["steps"]
        for k, v in r["clean"]["dense"].items():
            assert torch.equal(r["dense"][k], v), k


def _evaluate(mode: str) -> str | None:
    overrides = [*COMMON, f"run.mode={mode}", "evaluation.every=2", "evaluation.batches=1"]
    trainer = Trainer(build_config("demo", overrides), model=_model, data=SmallIds("eval"))
    try:
        trainer.run()
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("world", [1, 2])
def test_an_id_beyond_its_table_in_evaluation_is_one_line_on_every_rank(world):
    errors = run_ranks(_evaluate, world, "freescale", timeout=240)
    assert errors[0] is not None and len(set(errors)) == 1, errors
    rank = min(BAD_RANK, world - 1)
    assert errors[0] == (
        f"table 'items' (feature 'items'): rank {rank} looked up id {BAD_ID}, "
        f"outside [0, {ITEM_ROWS})"
    ), errors[0]
