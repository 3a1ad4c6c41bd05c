"""Collection behaviour on the fake backend: shapes, steps, no-grad, dtypes, padding."""

import pytest
import torch

from freescale.comm import run_threads
from freescale.embedding import (
    SGD,
    Adam,
    ShardedEmbeddingCollection,
    ShardingPlan,
    TableConfig,
)
from freescale.jagged import JaggedTensor

SCHEDULE_ADAM = Adam(lr=0.1, lr_schedule=lambda step: 0.1 / step)


def _init(coll):
    for name, t in coll.tables.items():
        g = torch.Generator().manual_seed(sum(map(ord, name)))  # per table, not per collection
        coll.set_table(name, torch.randn(t.rows, t.dim, generator=g).to(t.dtype))


def _tables_at_different_steps(comm):
    opt = SCHEDULE_ADAM
    shared = ShardedEmbeddingCollection(
        [TableConfig("a", 20, 4, optimizer=opt), TableConfig("b", 9, 4, optimizer=opt)], comm
    )
    assert len(shared.stores) == 1  # one (dtype, dim, optimizer) group
    alone = {
        n: ShardedEmbeddingCollection([TableConfig(n, r, 4, optimizer=opt)], comm)
        for n, r in (("a", 20), ("b", 9))
    }
    g = torch.Generator().manual_seed(3)
    for coll in (shared, *alone.values()):
        _init(coll)
    for keys in (["a"], ["a", "b"], ["b"], ["a", "b"], ["a"]):
        ids = {k: torch.randint(0, 9, (comm.rank + 3,), generator=g) for k in keys}
        out = shared(ids)
        sum((v * v).sum() for v in out.values()).backward()
        for k in keys:
            (alone[k]({k: ids[k]})[k] ** 2).sum().backward()
    steps = {n: shared.step_of(n) for n in ("a", "b")}
    diffs = {
        n: float((shared.full_table(n) - alone[n].full_table(n)).abs().max()) for n in ("a", "b")
    }
    return steps, diffs


@pytest.mark.numeric
def test_per_table_steps_drive_lr_and_bias_correction():
    """A table in a shared store updates bit for bit as in a store of its own:
    the same rows, the same sums in the same order, its own step."""
    for steps, diffs in run_threads(_tables_at_different_steps, 2):
        assert steps == {"a": 4, "b": 3}
        assert diffs == {"a": 0.0, "b": 0.0}


def _shapes_dtypes_and_no_grad(comm):
    coll = ShardedEmbeddingCollection(
        [
            TableConfig("f32", 30, 3),
            TableConfig("bf16", 30, 5, dtype=torch.bfloat16, padding_idx=2),
        ],
        comm,
        ShardingPlan(optimizer=SGD(lr=1.0)),
    )
    _init(coll)
    before = {n: coll.full_table(n) for n in coll.tables}
    ids2d = torch.tensor([[1, 2], [3, 4], [5, 2]])
    jagged = JaggedTensor(torch.tensor([2, 2, 7]), torch.tensor([0, 0, 3]))
    with torch.no_grad():
        out = coll({"f32": ids2d, "bf16": jagged})
    assert out["f32"].shape == (3, 2, 3) and out["f32"].dtype == torch.float32
    assert torch.equal(out["f32"], before["f32"][ids2d])
    assert isinstance(out["bf16"], JaggedTensor) and out["bf16"].values.dtype == torch.bfloat16
    assert torch.equal(out["bf16"].offsets, jagged.offsets)
    assert torch.equal(out["bf16"].values, before["bf16"][jagged.values])
    assert coll({}) == {}
    unchanged = all(torch.equal(coll.full_table(n), before[n]) for n in coll.tables)
    # With grad: the padding row is read but never updated; others are.
    out = coll({"bf16": jagged, "f32": torch.zeros(0, dtype=torch.int64)})
    out["bf16"].values.float().sum().backward()
    after = coll.full_table("bf16")
    padding_kept = torch.equal(after[2], before["bf16"][2])
    row7_moved = not torch.equal(after[7], before["bf16"][7])
    with pytest.raises(RuntimeError, match="backward ran twice"):
        out = coll({"f32": torch.tensor([1])})
        loss = out["f32"].sum()
        loss.backward(retain_graph=True)
        loss.backward()
    return unchanged, padding_kept, row7_moved, coll.step_of("f32")


def test_shapes_dtypes_padding_and_no_grad():
    for unchanged, padding_kept, row7_moved, steps in run_threads(_shapes_dtypes_and_no_grad, 2):
        assert unchanged and padding_kept and row7_moved
        assert steps == 2  # the no-grad call did not count


def test_construction_errors():
    from freescale.comm import FakeWorld

    comm = FakeWorld(1).communicator(0)
    with pytest.raises(ValueError, match="at least one table"):
        ShardedEmbeddingCollection([], comm)
    with pytest.raises(ValueError, match="duplicate table names"):
        ShardedEmbeddingCollection([TableConfig("t", 3, 2), TableConfig("t", 3, 2)], comm)
    with pytest.raises(ValueError, match="only one table"):
        ShardedEmbeddingCollection(
            [TableConfig("t", 3, 2), TableConfig("u", 3, 2, feature_names=("t",))], comm
        )
    coll = ShardedEmbeddingCollection([TableConfig("t", 3, 2)], comm)
    with pytest.raises(ValueError, match=r"weight \(4, 2\) != \(3, 2\)"):
        coll.set_table("t", torch.zeros(4, 2))
