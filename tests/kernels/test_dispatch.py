import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.kernels import (
    DispatchPlan,
    RowSharding,
    apply_dispatch,
    ranged_combine,
    ranged_dispatch,
    ranged_dispatch_ids,
)
from freescale.kernels.combine import ranged_combine_eager, ranged_combine_reference
from freescale.kernels.dispatch import (
    apply_dispatch_eager,
    apply_dispatch_reference,
    ranged_dispatch_eager,
    ranged_dispatch_reference,
)

from .strategies import ID_DTYPES, NUM_ROWS, ROW_KINDS, ids_tensor, rows_tensor, same


@st.composite
def dispatch_cases(draw, max_rows: int = 40):
    """(values, dest, world_size): world size 1 and empty destinations included."""
    world = draw(st.sampled_from([1, 2, 3, 8]))
    n = draw(st.integers(0, max_rows))
    seed = draw(st.integers(0, 2**16))
    hot = draw(st.booleans())  # every row to one rank
    g = torch.Generator().manual_seed(seed)
    dest = torch.randint(0, world, (n,), generator=g)
    if hot:
        dest.fill_(world - 1)
    dest = dest.to(draw(st.sampled_from([torch.int32, torch.int64])))
    return rows_tensor(n, draw(st.sampled_from(ROW_KINDS)), seed), dest, world


def assert_plans_equal(a: DispatchPlan, b: DispatchPlan) -> None:
    assert same(a.counts, b.counts)
    assert same(a.offsets, b.offsets)
    assert same(a.positions, b.positions)


def assert_dispatch_equal(got, want) -> None:
    assert same(got[0], want[0])
    assert_plans_equal(got[1], want[1])


@settings(max_examples=80, deadline=None)
@given(case=dispatch_cases())
def test_reference_is_a_stable_grouping(case):
    values, dest, world = case
    send, plan = ranged_dispatch_reference(values, dest, world)
    d = dest.tolist()
    assert plan.counts.tolist() == [d.count(r) for r in range(world)]
    assert plan.offsets[0] == 0 and plan.offsets[-1] == len(d)
    assert same(send[plan.positions], values)  # row j sits at positions[j]
    expected_order = sorted(range(len(d)), key=lambda j: (d[j], j))  # by dest, then input order
    assert same(send, values[torch.tensor(expected_order, dtype=torch.int64)])


@settings(max_examples=60, deadline=None)
@given(case=dispatch_cases())
def test_dispatcher_equals_reference_one_rank_shortcut_included(case):
    values, dest, world = case
    got = ranged_dispatch(values, dest, world, impl="torch")
    assert_dispatch_equal(got, ranged_dispatch_reference(values, dest, world))


@settings(max_examples=60, deadline=None)
@given(case=dispatch_cases())
def test_eager_equals_reference(case):
    values, dest, world = case
    want = ranged_dispatch_reference(values, dest, world)
    assert_dispatch_equal(ranged_dispatch_eager(values, dest, world), want)
    plan = want[1]
    assert same(apply_dispatch_eager(values, plan), want[0])
    assert same(ranged_combine_eager(want[0], plan), values)


@settings(max_examples=30, deadline=None)
@given(case=dispatch_cases(), block=st.sampled_from([None, 4, 16]))
def test_triton_equals_reference(triton_device, case, block):
    from freescale.kernels.triton_dispatch import ranged_dispatch_triton

    values, dest, world = case
    want = ranged_dispatch_reference(values, dest, world)
    got = ranged_dispatch_triton(
        values.to(triton_device), dest.to(triton_device), world, block=block
    )
    assert_dispatch_equal(got, want)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 40),
    seed=st.integers(0, 2**16),
    world=st.sampled_from([1, 3, 8, 1500]),
    scheme=st.sampled_from(["block", "hashed"]),
    dtype=st.sampled_from(ID_DTYPES),
    local=st.booleans(),
    block=st.sampled_from([None, 8]),
    block_size=st.sampled_from([1, 3]),
)
def test_ids_paths_equal_reference(
    triton_device, n, seed, world, scheme, dtype, local, block, block_size
):
    from freescale.kernels.triton_dispatch import ranged_dispatch_ids_triton

    sharding = RowSharding(NUM_ROWS, world, scheme, block_size)
    ids = ids_tensor(n, seed, dtype)
    want = ranged_dispatch_ids(ids, sharding, local=local, impl="torch")
    assert want[0].dtype == dtype
    assert_dispatch_equal(ranged_dispatch_ids(ids, sharding, local=local, impl="eager"), want)
    got = ranged_dispatch_ids_triton(ids.to(triton_device), sharding, local, block=block)
    assert_dispatch_equal(got, want)


@settings(max_examples=30, deadline=None)
@given(case=dispatch_cases(), kind=st.sampled_from(ROW_KINDS), seed=st.integers(0, 99))
def test_apply_and_combine_paths_agree(triton_device, case, kind, seed):
    """Gradients follow the ids' plan; combining the send layout restores the input."""
    _, dest, world = case
    plan = ranged_dispatch_reference(dest, dest, world)[1]
    grads = rows_tensor(dest.shape[0], kind, seed)
    send = apply_dispatch_reference(grads, plan)
    assert same(ranged_combine_reference(send, plan), grads)
    dev_plan = DispatchPlan(
        *(t.to(triton_device) for t in (plan.counts, plan.offsets, plan.positions))
    )
    for impl in ("torch", "eager", "triton"):
        p = dev_plan if impl == "triton" else plan
        dev = triton_device if impl == "triton" else "cpu"
        assert same(apply_dispatch(grads.to(dev), p, impl=impl), send), impl
        assert same(ranged_combine(send.to(dev), p, impl=impl), grads), impl


def test_public_dispatch_on_cpu_uses_reference():
    values = torch.tensor([10, 11, 12, 13])
    send, plan = ranged_dispatch(values, torch.tensor([2, 0, 2, 0]), 3)
    assert send.tolist() == [11, 13, 10, 12]
    assert plan.counts.tolist() == [2, 0, 2] and plan.offsets.tolist() == [0, 2, 2, 4]
    assert plan.positions.tolist() == [2, 0, 3, 1]


def test_validation_errors():
    with pytest.raises(ValueError, match="world_size"):
        ranged_dispatch(torch.zeros(2), torch.zeros(2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="one entry per row"):
        ranged_dispatch(torch.zeros(3), torch.zeros(2, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="integer"):
        ranged_dispatch(torch.zeros(2), torch.zeros(2), 2)
    with pytest.raises(ValueError, match="1-D integer"):
        ranged_dispatch_ids(torch.zeros(2), RowSharding(10, 2))
    plan = ranged_dispatch_reference(torch.zeros(2), torch.zeros(2, dtype=torch.int64), 1)[1]
    with pytest.raises(ValueError, match="rows"):
        ranged_combine(torch.zeros(3), plan)
    with pytest.raises(ValueError, match="rows"):
        apply_dispatch(torch.zeros(3), plan)


def test_dispatch_block_does_not_grow_with_world_size_up_to_1024(triton_device):
    """Compares cost O(BLOCK) per row: the block stays at 64 rows for every W the
    paper runs; beyond W = 1024 it grows like sqrt(W) so the W x blocks histogram
    stays smaller than the rows."""
    from freescale.kernels.triton_dispatch import block_size

    assert {block_size(w) for w in (1, 8, 32, 128, 256, 512, 1024)} == {64}
    sizes = [block_size(w) for w in (1025, 2048, 4096, 16384, 2**20)]
    assert sizes == sorted(sizes) and sizes[-1] == 1024 and sizes[2] == 128


def test_identity_plan_places_and_takes_back_rows_as_they_are():
    """One destination: the rows themselves (no copy), what the reference computes."""
    from freescale.kernels import DispatchPlan, apply_dispatch, ranged_combine
    from freescale.kernels.combine import ranged_combine_reference
    from freescale.kernels.dispatch import apply_dispatch_reference

    values = torch.randn(7, 3)
    plan = DispatchPlan.identity(7, values.device)
    assert plan.is_identity and plan.num_rows == 7 and plan.world_size == 1
    assert not {"counts", "offsets", "positions"} & set(vars(plan))  # built on first use only
    assert plan.counts.tolist() == [7] and plan.offsets.tolist() == [0, 7]
    assert torch.equal(plan.positions, torch.arange(7))
    assert apply_dispatch(values, plan) is values and ranged_combine(values, plan) is values
    assert torch.equal(apply_dispatch_reference(values, plan), values)
    assert torch.equal(ranged_combine_reference(values, plan), values)
