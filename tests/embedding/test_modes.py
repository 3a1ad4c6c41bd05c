"""The mode is given when the collection is built, and a user's loop reads the same in each.

Written from the user's side: swap a model with two embedding modules in
`Sync`, `SparseDataDist` and `Prioritized` mode, train it the way the docs
say (prefetch the next step, look the step up inside ``serving``), and get
bit-identical numbers; call a swapped module on its own where the mode needs
one lookup per step and get one line saying what to change.
"""

import copy

import pytest
import torch
from torch import nn

from freescale.comm import run_threads
from freescale.embedding import (
    SGD,
    Prioritized,
    ShardedEmbeddingCollection,
    ShardingPlan,
    SparseDataDist,
    Sync,
    TableConfig,
    swap,
)

STEPS, BATCH = 4, 6
MODES = {"sync": Sync, "sdd": SparseDataDist, "freescale": Prioritized}


class TwoTables(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(23, 4)
        self.category = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, items: torch.Tensor, categories: torch.Tensor) -> torch.Tensor:
        return self.head(self.item(items).mean(1) + self.category(categories)).squeeze(-1)


def _model() -> TwoTables:
    torch.manual_seed(0)
    return TwoTables()


def _batches(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        items = torch.randint(0, 23, (BATCH * world, 3), generator=g)
        categories = torch.randint(0, 5, (BATCH * world,), generator=g)
        y = torch.randn(BATCH * world, generator=g)
        mine = slice(rank * BATCH, (rank + 1) * BATCH)
        out.append((items[mine], categories[mine], y[mine]))
    return out


def _train(comm, model: TwoTables, mode: str) -> dict:
    model = copy.deepcopy(model)  # built by the caller: thread-ranks must not seed the RNG
    coll = swap(model, ShardingPlan(optimizer=SGD(lr=0.3)), comm, mode=MODES[mode]())
    batches = _batches(comm.rank, comm.world_size)

    def features(step: int) -> dict:
        items, categories, _ = batches[step]
        return {
            **model.item.lookup_features(items),
            **model.category.lookup_features(categories),
        }

    if coll.mode.prefetches:
        coll.prefetch(features(0))
    losses = []
    for step, (items, categories, y) in enumerate(batches):
        if coll.mode.prefetches and step + 1 < STEPS:
            coll.prefetch(features(step + 1))
        with coll.serving(features(step)):
            pred = model(items, categories)
        coll.prefetch_ids()  # the next step's ids exchange overlaps backward
        loss = ((pred - y) ** 2).sum() / (BATCH * comm.world_size)
        loss.backward()
        losses.append(loss.item())
    with torch.no_grad():  # evaluation calls the modules on their own, in any mode
        evaluated = model(*batches[0][:2])
    return {
        "losses": losses,
        "eval": evaluated,
        "tables": {t: coll.full_table(t) for t in ("item", "category")},
        "mode": type(coll.mode).__name__,
    }


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_mode_given_at_construction_trains_bit_identically(world_size):
    model = _model()
    runs = {m: run_threads(_train, world_size, model, m) for m in MODES}
    assert [runs[m][0]["mode"] for m in MODES] == ["Sync", "SparseDataDist", "Prioritized"]
    for mode in ("sdd", "freescale"):
        for got, want in zip(runs[mode], runs["sync"], strict=True):
            assert got["losses"] == want["losses"], mode
            assert torch.equal(got["eval"], want["eval"]), mode
            for name, table in want["tables"].items():
                assert torch.equal(got["tables"][name], table), (mode, name)


def _called_alone(comm, model: TwoTables, mode: str) -> str:
    model = copy.deepcopy(model)
    swap(model, ShardingPlan(optimizer=SGD(lr=0.3)), comm, mode=MODES[mode]())
    items, categories, _ = _batches(comm.rank, comm.world_size)[0]
    try:
        model(items, categories)
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("mode", ["sdd", "freescale"])
def test_a_swapped_module_called_alone_in_a_prefetching_mode_says_what_to_change(mode):
    (message,) = run_threads(_called_alone, 1, _model(), mode)
    assert message.startswith("'item' was called on its own")
    assert "collection.serving(features)" in message and "mode=Sync()" in message
    assert "\n" not in message


def test_a_swapped_module_called_alone_in_sync_mode_is_fine():
    assert run_threads(_called_alone, 1, _model(), "sync") == ["no error"]


def _misuse(comm) -> list[str]:
    tables = [TableConfig("t", 10, 4)]
    errors = []
    try:
        ShardedEmbeddingCollection(tables, comm).prefetch({"t": torch.tensor([1])})
    except RuntimeError as e:
        errors.append(str(e))
    mode = Prioritized()
    ShardedEmbeddingCollection(tables, comm, mode=mode)
    try:
        ShardedEmbeddingCollection(tables, comm, mode=mode)
    except ValueError as e:
        errors.append(str(e))
    return errors


def test_sync_mode_refuses_prefetch_and_a_mode_serves_one_collection():
    (errors,) = run_threads(_misuse, 1)
    assert "build the collection with mode=SparseDataDist() or mode=Prioritized()" in errors[0]
    assert "serves one collection" in errors[1]


def _overlap_of_other_ranks(comm, other) -> str:
    try:
        ShardedEmbeddingCollection([TableConfig("t", 10, 4)], comm, overlap_comm=other)
    except ValueError as e:
        return str(e)
    return "no error"


def test_the_overlap_communicator_must_span_the_same_ranks():
    (one_rank,) = run_threads(lambda c: c, 1)
    assert "same ranks" in run_threads(_overlap_of_other_ranks, 2, one_rank)[1]


def test_the_old_setters_are_gone():
    coll = run_threads(lambda c: ShardedEmbeddingCollection([TableConfig("t", 10, 4)], c), 1)[0]
    assert isinstance(coll.mode, Sync)
    for name in ("set_prioritized", "set_overlap_comm", "prioritized", "host_checked_inputs"):
        assert not hasattr(coll, name), name
