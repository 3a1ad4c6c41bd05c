"""Sharded training equals an unsharded reference, at world sizes 1, 2, 4 (gloo).

Each world size is one `run_ranks` call that trains all three optimizers for
20 steps twice (to prove bit-identical repeats); the split of the global
batch is uneven and one rank has no ids at every step.
"""

import pytest
import torch

from freescale.comm import TorchCommunicator, run_threads
from freescale.testing import run_ranks
from tests.embedding._train import pack, parity_tol, reference, train_sharded, unpack

OPTIMIZERS = ("sgd", "adagrad", "adam")
STEPS = 20


def _parity_rank(plan_kwargs: dict) -> dict:
    comm = TorchCommunicator()
    runs = {
        opt: [train_sharded(comm, opt, STEPS, plan_kwargs) for _ in range(2)] for opt in OPTIMIZERS
    }
    return pack(runs)


@pytest.fixture(scope="module")
def references() -> dict:
    return {opt: reference(opt, STEPS) for opt in OPTIMIZERS}


def assert_matches(result: dict, ref: dict, optimizer: str) -> None:
    """Tables and optimizer state of a sharded run equal the reference's up to
    the reordering of their sums (`parity_tol`)."""
    tol = parity_tol(optimizer, STEPS, ref["stats"])
    for name, table in ref["tables"].items():
        got = result["tables"][name]
        assert got["step"] == table["step"]
        torch.testing.assert_close(got["weight"], table["weight"], **tol["weight"], msg=name)
        assert set(got["state"]) == set(table["state"])
        for key, value in table["state"].items():
            torch.testing.assert_close(got["state"][key], value, **tol["state"], msg=name + key)


def assert_losses_match(global_losses: list[float], ref: dict, optimizer: str) -> None:
    tol = parity_tol(optimizer, STEPS, ref["stats"])["loss"]
    torch.testing.assert_close(torch.tensor(global_losses), torch.tensor(ref["losses"]), **tol)


def _assert_same_tables(a: dict, b: dict) -> None:
    for name, table in a["tables"].items():
        other = b["tables"][name]
        assert torch.equal(table["weight"], other["weight"])
        for key, value in table["state"].items():
            assert torch.equal(value, other["state"][key])


@pytest.mark.parametrize(
    ("world_size", "plan_kwargs"),
    [
        pytest.param(1, {}, marks=pytest.mark.numeric),
        pytest.param(2, {"assignment": "block"}, marks=pytest.mark.numeric),
        (4, {"assignment": "hashed", "block_size": 3}),
    ],
)
def test_sharded_training_matches_reference(world_size, plan_kwargs, references):
    per_rank = [unpack(r) for r in run_ranks(_parity_rank, world_size, plan_kwargs, timeout=150)]
    for opt in OPTIMIZERS:
        ref = references[opt]
        runs = [r[opt] for r in per_rank]
        first = runs[0][0]
        assert_matches(first, ref, opt)
        # Every rank gathered the same tables; repeats are bit-identical.
        for rank_runs in runs:
            _assert_same_tables(first, rank_runs[0])
            _assert_same_tables(first, rank_runs[1])
            assert rank_runs[0]["losses"] == rank_runs[1]["losses"]
        # The losses the ranks saw add up to the reference's global loss.
        global_losses = [sum(r[0]["losses"][s] for r in runs) for s in range(STEPS)]
        assert_losses_match(global_losses, ref, opt)


@pytest.mark.numeric
def test_fake_backend_matches_reference_at_three_ranks(references):
    ref = references["adam"]
    per_rank = run_threads(train_sharded, 3, "adam", STEPS, {"block_size": 2})
    assert_matches(per_rank[0], ref, "adam")
    global_losses = [sum(r["losses"][s] for r in per_rank) for s in range(STEPS)]
    assert_losses_match(global_losses, ref, "adam")
