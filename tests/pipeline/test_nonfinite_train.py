"""Non-finite steps in the trainer: skipped on every rank (tables, dense weights
and both optimizers untouched), counted, and fatal per the ``nonfinite`` policy
with the same one-line error on every rank, in seconds."""

from __future__ import annotations

import math
import time

import pytest
import torch

from freescale.config import build_config
from freescale.pipeline.nonfinite import NonFiniteError
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks

BAD_RANK = 1
COMMON = [
    "run.warmup=1", "evaluation.every=0", "output.progress=false", "run.batch_size=8",
    "run.timeout_s=60",
]  # fmt: skip


def _poisoned(overrides: list[str], steps: set[int]) -> Trainer:
    """A trainer whose loss is NaN at ``steps`` on rank BAD_RANK (`faults.nan_steps`)."""
    nan = [f"faults.nan_steps={','.join(map(str, sorted(steps)))}", f"faults.nan_ranks={BAD_RANK}"]
    return Trainer(build_config("demo", [*overrides, *nan]))


def _snapshot(trainer: Trainer) -> dict:
    trainer.embeddings.flush()
    opt = trainer.optimizer.state_dict()["state"]
    return {
        "table": trainer.embeddings.full_table("item_emb"),
        "table_state": trainer.embeddings.full_optimizer_state("item_emb"),
        "table_step": trainer.embeddings.step_of("item_emb"),
        "dense": {k: v.detach().clone() for k, v in trainer.dense_state_dict().items()},
        "adam": {(i, k): v.clone() for i, s in opt.items() for k, v in s.items()},
    }


def _skip_rank(world_size: int, mode: str) -> dict:
    poisoned = _poisoned([*COMMON, mode, "run.steps=4", "faults.nonfinite=skip"], {3})
    summary = poisoned.run()
    clean = Trainer(build_config("demo", [*COMMON, mode, "run.steps=3"]))
    clean.run()
    return {
        "summary": summary,
        "flags": [s["nonfinite_skipped"] for s in poisoned.summary.steps],
        "poisoned": _snapshot(poisoned),
        "clean": _snapshot(clean),
    }


@pytest.mark.parametrize("mode", ["run.mode=sync", "run.mode=sdd", "run.mode=freescale"])
def test_a_nonfinite_step_changes_nothing_and_is_counted(mode):
    per_rank = run_ranks(_skip_rank, 2, 2, mode, timeout=240)
    assert per_rank[0]["summary"]["nonfinite_skipped"] == 1
    for r in per_rank:
        assert r["flags"] == [False, False, False, True]  # the same on every rank
        got, want = r["poisoned"], r["clean"]
        assert torch.equal(got["table"], want["table"])
        assert got["table_step"] == want["table_step"] == 3
        for k, v in want["table_state"].items():
            assert torch.equal(got["table_state"][k], v), k
        for k, v in want["dense"].items():
            assert torch.equal(got["dense"][k], v), k
        assert got["adam"].keys() == want["adam"].keys()
        for k, v in want["adam"].items():
            assert torch.equal(got["adam"][k], v), k  # moments and step counts


def _raise_rank(world_size: int, extra: list[str], steps: set[int]) -> dict:
    trainer = _poisoned([*COMMON, "run.steps=8", *extra], steps)
    start = time.perf_counter()
    try:
        trainer.run()
    except NonFiniteError as e:
        return {"error": str(e), "seconds": time.perf_counter() - start,
                "losses": [s["loss"] for s in trainer.summary.steps]}  # fmt: skip
    return {"error": None, "losses": [s["loss"] for s in trainer.summary.steps],
            "skipped": [s["nonfinite_skipped"] for s in trainer.summary.steps]}  # fmt: skip


def test_consecutive_nonfinite_steps_raise_the_same_error_on_every_rank():
    per_rank = run_ranks(_raise_rank, 2, 2, ["faults.nonfinite_max_skips=1"], {2, 3}, timeout=240)
    errors = [r["error"] for r in per_rank]
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert errors[0].startswith("step 3: non-finite loss or gradients (first seen on rank 1)")
    assert "2 consecutive steps" in errors[0]
    for r in per_rank:
        assert r["seconds"] < 20  # not the 60 s collective timeout


def test_isolated_nonfinite_steps_are_skipped_and_training_goes_on():
    per_rank = run_ranks(_raise_rank, 2, 2, ["faults.nonfinite_max_skips=1"], {2, 5}, timeout=240)
    for r in per_rank:
        assert r["error"] is None
        assert r["skipped"] == [s in (2, 5) for s in range(8)]
        assert all(math.isfinite(x) for s, x in enumerate(r["losses"]) if s not in (2, 5))
