"""The HSTU-style model through the trainer: the three modes give
bit-identical losses, table, optimizer state and dense weights at two gloo
ranks, with and without the load balancer (tests/models/test_hstu_learns.py:
it learns, and the configuration names it)."""

import pytest
import torch

from freescale.config import build_config
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks

# By name, so the model.* options reach the HSTU factory (a factory passed
# to Trainer beside the built-in model's section gets none of them).
SMALL = ["model=freescale.models.hstu:build", "model.dim=16", "model.heads=2", "model.layers=2"]


def _run(overrides: list[str]) -> dict:
    cfg = build_config("demo", [*overrides, "output.progress=false"])
    trainer = Trainer(cfg)
    emb = trainer.embeddings
    before = emb.full_table("item_emb")
    trainer.run()
    return {
        "before": before,
        "losses": [s["loss"] for s in trainer.summary.steps],
        "evals": [e["ne"] for e in trainer.summary.evals],
        "table": emb.full_table("item_emb"),
        "state": emb.full_optimizer_state("item_emb"),
        "dense": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert torch.equal(a["table"], b["table"])
    assert a["state"].keys() == b["state"].keys()
    for k in a["state"]:
        assert torch.equal(a["state"][k], b["state"][k]), k
    assert a["dense"].keys() == b["dense"].keys()
    for k in a["dense"]:
        assert torch.equal(a["dense"][k], b["dense"][k]), k


def _all_modes(overrides: list[str]) -> dict[str, dict]:
    """The three modes one after another in the same ranks: a run_ranks call
    re-imports the trainer in fresh processes (most of a short test's time),
    and each Trainer seeds and builds everything it uses itself."""
    return {mode: _run([*overrides, f"run.mode={mode}"]) for mode in ("sync", "sdd", "freescale")}


def _modes_agree(world: int, balance: str, attention: str = "auto") -> None:
    common = [
        *SMALL, f"model.attention={attention}", "run.steps=6", "run.warmup=1", f"run.nproc={world}",
        f"balance={balance}", "run.batch_size=8", "evaluation.every=0", "pipeline.prioritize=on",
    ]  # fmt: skip
    ranks = run_ranks(_all_modes, world, common, timeout=240)
    for runs in ranks:
        for mode in ("sdd", "freescale"):
            _assert_same(runs["sync"], runs[mode])
    first = ranks[0]["sync"]
    changed = (first["table"] != first["before"]).any(dim=1)
    assert 0 < int(changed.sum()) < changed.numel()  # touched rows only
    for k, v in ranks[-1]["sync"]["dense"].items():  # replicated weights agree across ranks
        assert torch.equal(first["dense"][k], v), k
    trained = [k for k in first["dense"] if "bias.time" in k or "bias.position" in k]
    assert trained and all(first["dense"][k].abs().sum() > 0 for k in trained)  # rab learned


@pytest.mark.parametrize("balance", [pytest.param("none", marks=pytest.mark.slow), "cost"])
def test_modes_are_bit_identical_at_two_ranks(balance):
    _modes_agree(2, balance)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["reference", "padded"])
@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("balance", ["none", "fbs", "cost"])
def test_modes_are_bit_identical_at_every_world_size(world, balance, attention):
    _modes_agree(world, balance, attention)
