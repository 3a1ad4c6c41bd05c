"""Checkpoint + resume: a resumed run is bit-identical to the uninterrupted one,
and adaptive balancers are reproducible under ``deterministic = true``."""

import json

import pytest
import torch

from freescale.config import MODES, build_config
from freescale.pipeline.train import Trainer
from freescale.state.checkpoint import PREFIX, find_checkpoint
from freescale.testing import run_ranks

COMMON = ["run.warmup=1", "evaluation.every=0", "output.progress=false", "run.batch_size=16"]


def _state(trainer: Trainer) -> dict:
    return {
        "losses": [(s["step"], s["loss"]) for s in trainer.summary.steps],
        "table": trainer.embeddings.full_table("item_emb"),
        "opt": trainer.embeddings.full_optimizer_state("item_emb"),
        "dense": {k: v.detach().clone() for k, v in trainer.dense_state_dict().items()},
        "adam": [{k: v.clone() for k, v in s.items()} for s in trainer.optimizer.state.values()],
    }


def _resume_rank(overrides: list[str], ckdir: str) -> tuple[dict, dict]:
    every = ["checkpoint.every=5", f"checkpoint.dir={ckdir}"]
    full = Trainer(build_config("demo", [*COMMON, *overrides, *every]))
    full.run()
    resume = f"checkpoint.resume={ckdir}/{PREFIX}00000005"
    resumed = Trainer(build_config("demo", [*COMMON, *overrides, resume]))
    torch.manual_seed(123)  # the RNG state must come from the checkpoint
    resumed.run()
    return _state(full), _state(resumed)


def _assert_same(a: dict, b: dict, steps_of_b: bool = False) -> None:
    losses_a = dict(a["losses"])
    for step, loss in b["losses"]:
        assert losses_a[step] == loss, step
    assert torch.equal(a["table"], b["table"])
    assert a["opt"].keys() == b["opt"].keys()
    for k in a["opt"]:
        assert torch.equal(a["opt"][k], b["opt"][k]), k
    for k in a["dense"]:
        assert torch.equal(a["dense"][k], b["dense"][k]), k
    for sa, sb in zip(a["adam"], b["adam"], strict=True):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


# Every mode, without and with balancing: the dense gradient sum's buckets must
# not depend on the run's history (a resumed run starts them afresh), else from
# 3 ranks on a sum's order, and with it its bits, differ after a resume.
VARIANTS = [
    [f"run.mode={mode}", f"balance={balance}", "run.deterministic=true"]
    for mode in MODES
    for balance in ("none", "cost")
]


def _resume_variants(ckdir: str, steps: int) -> list[tuple[dict, dict]]:
    """`_resume_rank` of each of `VARIANTS`, on this rank (one process group)."""
    return [
        _resume_rank([f"run.steps={steps}", *v], f"{ckdir}/{i}") for i, v in enumerate(VARIANTS)
    ]


def _check_resumes(world: int, ckdir: str, steps: int) -> None:
    for per_variant in run_ranks(_resume_variants, world, ckdir, steps, timeout=480):
        for variant, (full, resumed) in zip(VARIANTS, per_variant, strict=True):
            assert [s for s, _ in resumed["losses"]] == list(range(5, steps)), variant
            _assert_same(full, resumed)


def test_resume_at_three_ranks_is_bit_identical(tmp_path):
    """Three-term sums depend on their order: a resumed run must group its
    gradients as the uninterrupted run did."""
    _check_resumes(3, str(tmp_path), 8)


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 5])
def test_resume_at_four_and_five_ranks_is_bit_identical(tmp_path, world):
    _check_resumes(world, str(tmp_path), 10)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "sdd", "freescale"])
def test_resume_is_bit_identical_with_cost_balancing(tmp_path, mode):
    if mode not in MODES:
        pytest.skip(f"mode {mode} does not exist yet")
    overrides = ["run.steps=10", f"run.mode={mode}", "balance=cost", "run.deterministic=true"]
    per_rank = run_ranks(_resume_rank, 2, overrides, str(tmp_path), timeout=240)
    for full, resumed in per_rank:
        assert [s for s, _ in resumed["losses"]] == list(range(5, 10))
        _assert_same(full, resumed)
    # keep=2 newest complete checkpoints (5 and 10), nothing partial left behind
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [f"{PREFIX}00000005", f"{PREFIX}00000010"], names
    assert json.loads((find_checkpoint(tmp_path) / "manifest.json").read_text())["step"] == 10


def _run_rank(overrides: list[str]) -> dict:
    trainer = Trainer(build_config("demo", [*COMMON, *overrides]))
    trainer.run()
    return _state(trainer)


@pytest.mark.slow
@pytest.mark.parametrize("balance", ["vbs", "cost"])
def test_adaptive_balancers_are_reproducible_when_deterministic(balance):
    """Same seed twice, and sync vs sdd: bit-identical under vbs and cost (the
    plans no longer follow measured times, which differed from step 4-6 on)."""
    common = ["run.steps=12", f"balance={balance}", "run.deterministic=true",
              "faults.delay_compute_ms=3",
              "faults.delay_ranks=1"]  # fmt: skip
    sync = run_ranks(_run_rank, 2, [*common, "run.mode=sync"], timeout=240)
    sdd = run_ranks(_run_rank, 2, [*common, "run.mode=sdd"], timeout=240)
    for a, b in zip(sync, sdd, strict=True):
        assert len(a["losses"]) == 12
        _assert_same(a, b)
