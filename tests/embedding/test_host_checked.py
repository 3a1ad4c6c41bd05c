"""``inputs_checked``: the caller checked ids and offsets on the host.

The device check of the preflight is then skipped and, with one rank, so is
the whole exchange (the forward never waits for the GPU). The numbers must
not change, and lookups that are not the caller's own batches (evaluation,
under `prefetch_disabled`) and problems known on the host are still caught.
"""

import threading
from collections import Counter

import pytest
import torch

from freescale.comm import run_threads
from freescale.embedding import (
    Prioritized,
    ShardedEmbeddingCollection,
    SparseDataDist,
    TableConfig,
    input_dist,
)
from freescale.jagged import JaggedTensor
from tests.embedding._train import make_collection, run_steps, snapshot


def _train(comm, optimizer: str, checked: bool) -> dict:
    coll = make_collection(comm, optimizer, {"block_size": 3}, inputs_checked=checked)
    losses = run_steps(coll, comm, range(4))
    return {"losses": losses, "tables": snapshot(coll)}


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_checked_inputs_train_bit_for_bit_the_same(world_size, optimizer):
    checked = run_threads(_train, world_size, optimizer, True)
    unchecked = run_threads(_train, world_size, optimizer, False)
    assert _equal(checked, unchecked)


def _preflights(comm, checked: bool, monkeypatch) -> int:
    calls = Counter()  # per rank thread
    real = input_dist.start_preflight

    def counted(*args, **kwargs):
        calls[threading.get_ident()] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(input_dist, "start_preflight", counted)
    coll = make_collection(comm, "sgd", {}, inputs_checked=checked)
    run_steps(coll, comm, range(2))
    return calls[threading.get_ident()]


def test_one_rank_with_checked_inputs_exchanges_nothing(monkeypatch):
    assert run_threads(_preflights, 1, True, monkeypatch) == [0]
    assert run_threads(_preflights, 1, False, monkeypatch) == [2]
    assert run_threads(_preflights, 2, True, monkeypatch) == [2, 2]  # counts must travel


def _still_caught(comm) -> list[str]:
    table = TableConfig("t", 10, 4, feature_names=("x",))
    coll = ShardedEmbeddingCollection([table], comm, inputs_checked=True)
    messages = []
    cases = [
        ({"x": JaggedTensor(torch.tensor([3, 12]), torch.tensor([0, 2]))}, True),  # evaluation
        ({"y": torch.tensor([1])}, False),  # unknown feature: known on the host
        ({"x": torch.tensor([1.0])}, False),  # float ids: known on the host
    ]
    for features, evaluation in cases:
        try:
            if evaluation:
                with coll.prefetch_disabled():
                    coll(features)
            else:
                coll(features)
            messages.append("no error")
        except ValueError as e:
            messages.append(str(e))
    return messages


@pytest.mark.parametrize("world_size", [1, 2])
def test_what_the_host_did_not_check_is_still_caught(world_size):
    for messages in run_threads(_still_caught, world_size):
        assert "looked up id 12, outside [0, 10)" in messages[0]
        assert "looked up feature(s) ['y'] that no table declares" in messages[1]
        assert "ids of a non-integer dtype" in messages[2]


def _waits_after_prefetch(comm, checked: bool, prioritized: bool) -> list[bool]:
    mode = Prioritized() if prioritized else SparseDataDist()
    coll = make_collection(comm, "sgd", {}, mode=mode, inputs_checked=checked)
    features = {"uih": JaggedTensor(torch.tensor([1, 2]), torch.tensor([0, 2]))}
    before = coll.prefetch_waits_for_gpu()
    coll.prefetch(features)
    waits = coll.prefetch_waits_for_gpu()
    coll.prefetch_ids()
    return [before, waits, coll.prefetch_waits_for_gpu()]


@pytest.mark.parametrize("prioritized", [False, True])
def test_prefetch_waits_for_gpu_only_while_counts_are_unread(prioritized):
    assert run_threads(_waits_after_prefetch, 1, True, prioritized) == [[False, False, False]]
    assert run_threads(_waits_after_prefetch, 1, False, prioritized) == [[False, True, False]]
    assert run_threads(_waits_after_prefetch, 2, True, prioritized) == [[False, True, False]] * 2
