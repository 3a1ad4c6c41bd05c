"""Sharded training equals an unsharded reference, at world sizes 1, 2, 4 (gloo).

Each world size is one `run_ranks` call that trains all three optimizers for
20 steps twice (to prove bit-identical repeats); the split of the global
batch is uneven and one rank has no ids at every step.
"""

import pytest
import torch

from freescale.comm import TorchCommunicator, run_threads
from freescale.testing import run_ranks
from tests.embedding._train import max_rel_error, pack, reference, train_sharded, unpack

OPTIMIZERS = ("sgd", "adagrad", "adam")
STEPS = 20
TOL = 1e-6


def _parity_rank(plan_kwargs: dict) -> dict:
    comm = TorchCommunicator()
    runs = {
        opt: [train_sharded(comm, opt, STEPS, plan_kwargs) for _ in range(2)] for opt in OPTIMIZERS
    }
    return pack(runs)


@pytest.fixture(scope="module")
def references() -> dict:
    return {opt: reference(opt, STEPS) for opt in OPTIMIZERS}


def _assert_matches(result: dict, ref: dict) -> None:
    for name, table in ref["tables"].items():
        got = result["tables"][name]
        assert got["step"] == table["step"]
        err = max_rel_error(got["weight"], table["weight"])
        assert err <= TOL, f"{name} weight rel err {err:.2e}"
        assert set(got["state"]) == set(table["state"])
        for key, value in table["state"].items():
            err = max_rel_error(got["state"][key], value)
            assert err <= TOL, f"{name} {key} rel err {err:.2e}"


def _assert_same_tables(a: dict, b: dict) -> None:
    for name, table in a["tables"].items():
        other = b["tables"][name]
        assert torch.equal(table["weight"], other["weight"])
        for key, value in table["state"].items():
            assert torch.equal(value, other["state"][key])


@pytest.mark.parametrize(
    ("world_size", "plan_kwargs"),
    [
        (1, {}),
        (2, {"assignment": "block"}),
        (4, {"assignment": "hashed", "block_size": 3}),
    ],
)
def test_sharded_training_matches_reference(world_size, plan_kwargs, references):
    per_rank = [unpack(r) for r in run_ranks(_parity_rank, world_size, plan_kwargs, timeout=150)]
    for opt in OPTIMIZERS:
        ref = references[opt]
        runs = [r[opt] for r in per_rank]
        first = runs[0][0]
        _assert_matches(first, ref)
        # Every rank gathered the same tables; repeats are bit-identical.
        for rank_runs in runs:
            _assert_same_tables(first, rank_runs[0])
            _assert_same_tables(first, rank_runs[1])
            assert rank_runs[0]["losses"] == rank_runs[1]["losses"]
        # The losses the ranks saw add up to the reference's global loss.
        global_losses = [sum(r[0]["losses"][s] for r in runs) for s in range(STEPS)]
        assert global_losses == pytest.approx(ref["losses"], rel=1e-5)


def test_fake_backend_matches_reference_at_three_ranks(references):
    ref = references["adam"]
    per_rank = run_threads(train_sharded, 3, "adam", STEPS, {"block_size": 2})
    _assert_matches(per_rank[0], ref)
    global_losses = [sum(r["losses"][s] for r in per_rank) for s in range(STEPS)]
    assert global_losses == pytest.approx(ref["losses"], rel=1e-5)
