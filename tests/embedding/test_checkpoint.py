"""Checkpoint save -> load -> continue equals an uninterrupted run, bit for bit;
`TableEntries` checkpoints load at another world size."""

import math

import pytest
import torch

from freescale.comm import TorchCommunicator
from freescale.embedding import TableEntries, load, save
from freescale.testing import RankError, run_ranks
from tests.embedding._train import make_collection, pack, run_steps, snapshot, unpack


def _save_resume_rank(path: str) -> bytes:
    comm = TorchCommunicator()
    coll = make_collection(comm, "adam", {"block_size": 2})
    run_steps(coll, comm, range(5))
    save(coll, path)
    uninterrupted = run_steps(coll, comm, range(5, 10))
    expected = snapshot(coll)
    # A fresh collection with other initial values, restored from the checkpoint.
    resumed = make_collection(comm, "adam", {"block_size": 2}, seed=7)
    resumed.set_table("items", torch.zeros(97, 8))
    load(resumed, path)
    losses = run_steps(resumed, comm, range(5, 10))
    return pack({"expected": expected, "got": snapshot(resumed), "losses": (uninterrupted, losses)})


def _load_rank(path: str) -> str:
    coll = make_collection(TorchCommunicator(), "adam", {"block_size": 2})
    load(coll, path)
    return "loaded"


def test_save_load_continue_is_bit_identical(tmp_path):
    path = str(tmp_path / "ckpt")
    per_rank = [unpack(r) for r in run_ranks(_save_resume_rank, 2, path, timeout=90)]
    for r in per_rank:
        assert r["losses"][0] == r["losses"][1]
        for name, table in r["expected"].items():
            got = r["got"][name]
            assert got["step"] == table["step"] == 10
            assert torch.equal(got["weight"], table["weight"])
            assert set(got["state"]) == {"exp_avg", "exp_avg_sq"}
            for key, value in table["state"].items():
                assert torch.equal(got["state"][key], value)
    # Loading at another world size fails loudly instead of scrambling rows.
    with pytest.raises(RankError, match=r"rank0of1"):
        run_ranks(_load_rank, 1, path, timeout=60)


def _adagrad_into_sgd_rank(path: str) -> str:
    comm = TorchCommunicator()
    coll = make_collection(comm, "adagrad", {"block_size": 2})
    run_steps(coll, comm, range(2))
    save(coll, path)
    sgd = make_collection(comm, "sgd", {"block_size": 2})
    try:
        load(sgd, path)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_optimizer_state_without_a_place_is_an_error_on_every_rank(tmp_path):
    """An Adagrad checkpoint loaded into SGD tables used to drop sum_sq silently."""
    messages = run_ranks(_adagrad_into_sgd_rank, 2, str(tmp_path / "ckpt"), timeout=90)
    assert messages[0] == messages[1]
    assert "holds state this module lacks" in messages[0] and "sum_sq" in messages[0]


class _NoGroup:
    """A communicator without a torch process group, as the SM-free ones are."""

    def __init__(self, comm: TorchCommunicator) -> None:
        self._comm = comm

    def __getattr__(self, name: str):
        if name == "group":
            raise AttributeError(name)
        return getattr(self._comm, name)


def _entries_save_rank(path: str) -> bytes:
    comm = _NoGroup(TorchCommunicator())
    coll = make_collection(comm, "adam", {"block_size": 2})
    run_steps(coll, comm, range(5))
    entries = TableEntries(coll)
    types = {k: type(v).__name__ for k, v in entries.state_dict().items()}
    save(entries, path)
    return pack({"snapshot": snapshot(coll), "types": types})


def _entries_load_rank(path: str) -> bytes:
    comm = TorchCommunicator()
    coll = make_collection(comm, "adam", {"block_size": 3}, seed=7)  # another layout too
    load(TableEntries(coll), path)
    loaded = snapshot(coll)
    losses = run_steps(coll, comm, range(5, 7))
    return pack({"snapshot": loaded, "losses": losses})


def test_table_entries_saved_at_2_ranks_load_at_1_and_4(tmp_path):
    """`TableEntries`: weights, Adam moments and step counts load bit for bit at
    another world size (and sharding layout); rows travel over a torch group
    even when the collection's communicator has none (SM-free)."""
    path = str(tmp_path / "ckpt")
    saved = [unpack(r) for r in run_ranks(_entries_save_rank, 2, path, timeout=90)]
    types = saved[0]["types"]
    assert types["items.weight"] == types["items.optimizer.exp_avg"] == "DTensor", types
    assert types["items.optimizer.step"] == "Tensor"
    expected = saved[0]["snapshot"]
    for world in (1, 4):
        for got in [unpack(r) for r in run_ranks(_entries_load_rank, world, path, timeout=90)]:
            for name, table in expected.items():
                mine = got["snapshot"][name]
                assert mine["step"] == table["step"] == 5
                assert torch.equal(mine["weight"], table["weight"]), (world, name)
                assert mine["state"].keys() == table["state"].keys()
                for key, value in table["state"].items():
                    assert torch.equal(mine["state"][key], value), (world, name, key)
            assert all(math.isfinite(x) for x in got["losses"])
