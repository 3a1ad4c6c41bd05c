"""Bad input on one rank: every rank raises the same ValueError, promptly, before any update."""

import time

import pytest
import torch

from freescale.comm import TorchCommunicator, run_threads
from freescale.embedding import ShardedEmbeddingCollection, TableConfig
from freescale.jagged import JaggedTensor
from freescale.testing import run_ranks
from tests.embedding._train import make_collection, pack, run_steps, snapshot, unpack

BAD_RANK = 1

# case -> (feature, a bad JaggedTensor for rank BAD_RANK, expected message fragment)
CASES = {
    "too_large": (
        "uih",
        JaggedTensor(torch.tensor([3, 97, 5]), torch.tensor([0, 3])),
        "table 'items' (feature 'uih'): rank 1 looked up id 97, outside [0, 97)",
    ),
    "negative": (
        "c2",
        JaggedTensor(torch.tensor([0, -4]), torch.tensor([0, 1, 2])),
        "table 'cands' (feature 'c2'): rank 1 looked up id -4, outside [0, 41)",
    ),
    "lengths": (
        "act",
        JaggedTensor(torch.tensor([1, 2, 3]), torch.tensor([0, 2, 5])),
        "table 'actions' (feature 'act'): rank 1 passed lengths summing to 5 for 3 ids",
    ),
    "negative_length": (
        "act",
        JaggedTensor(torch.tensor([1, 2]), torch.tensor([0, 3, 2])),
        "rank 1 passed offsets with start/negative length -1",
    ),
    "float_ids": (
        "uih",
        JaggedTensor(torch.tensor([1.0]), torch.tensor([0, 1])),
        "rank 1 passed ids of a non-integer dtype",
    ),
}


def _valid_features(rank: int) -> dict[str, JaggedTensor]:
    ids = torch.tensor([rank, rank + 1, 2 * rank])
    offsets = torch.tensor([0, 1, 3])
    return {f: JaggedTensor(ids, offsets) for f in ("uih", "cand", "act", "c2")}


def _bad_input_rank(comm=None) -> bytes:
    comm = comm if comm is not None else TorchCommunicator()
    coll = make_collection(comm, "adam", {})
    run_steps(coll, comm, range(2))  # optimizer state is non-trivial
    before = snapshot(coll)
    outcome = {}
    for case, (feature, bad, _) in CASES.items():
        features = _valid_features(comm.rank)
        if comm.rank == BAD_RANK:
            features[feature] = bad
        start = time.monotonic()
        try:
            out = coll(features)
            sum(v.values.sum() for v in out.values()).backward()
            outcome[case] = ("no error", 0.0)
        except ValueError as exc:
            outcome[case] = (str(exc), time.monotonic() - start)
    # Mismatched keys and unknown features are caught the same way.
    features = _valid_features(comm.rank)
    if comm.rank == BAD_RANK:
        features["nope"] = features.pop("c2")
    try:
        coll(features)
        outcome["keys"] = ("no error", 0.0)
    except ValueError as exc:
        outcome["keys"] = (str(exc), 0.0)
    after = snapshot(coll)
    # The collection still works after the errors: no collective was left half done.
    run_steps(coll, comm, range(2, 3))
    return pack({"outcome": outcome, "before": before, "after": after})


def _check(per_rank: list[dict]) -> None:
    for case, (_, _, fragment) in CASES.items():
        messages = {r["outcome"][case][0] for r in per_rank}
        assert len(messages) == 1, f"{case}: ranks disagree: {messages}"
        assert fragment in messages.pop()
        assert max(r["outcome"][case][1] for r in per_rank) < 5.0
    for r in per_rank:
        assert "looked up different feature keys" in r["outcome"]["keys"][0]
        for name, table in r["before"].items():
            assert torch.equal(table["weight"], r["after"][name]["weight"])
            for key, value in table["state"].items():
                assert torch.equal(value, r["after"][name]["state"][key])
            assert table["step"] == r["after"][name]["step"]


def test_bad_input_on_one_rank_raises_everywhere_gloo():
    start = time.monotonic()
    per_rank = [unpack(r) for r in run_ranks(_bad_input_rank, 4, timeout=60)]
    _check(per_rank)
    assert time.monotonic() - start < 30


def test_bad_input_on_one_rank_raises_everywhere_fake():
    _check([unpack(r) for r in run_threads(_bad_input_rank, 2)])


def _unknown_feature_everywhere(comm) -> str:
    coll = ShardedEmbeddingCollection([TableConfig("t", 10, 4)], comm)
    with pytest.raises(ValueError, match=r"rank 0 looked up feature\(s\) \['x'\] that no table"):
        coll({"x": torch.tensor([1])})
    return "ok"


def test_unknown_feature_raises_on_every_rank():
    assert run_threads(_unknown_feature_everywhere, 3) == ["ok"] * 3
