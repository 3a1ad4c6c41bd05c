"""`WorldLengths`, `Plan`, `check_plan` and `route`: the host-side bookkeeping."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.balance import (
    Plan,
    WorldLengths,
    batch_features,
    check_plan,
    equal_counts,
    idle_fraction,
    rank_loads,
    route,
    sample_features,
)
from freescale.balance.exchange import permute_batch
from freescale.jagged import SampleBatch
from freescale.testing.batches import random_batch
from tests.balance._helpers import rank_batches, reverse_partitioner, worlds


def test_world_from_ranks_and_batches_agree():
    batches = rank_batches([3, 0, 4], seed=1)
    world = WorldLengths.from_batches(batches)
    assert world.batch_sizes == (3, 0, 4) and world.total == 7 and world.world_size == 3
    flat = SampleBatch.concat(batches)
    assert torch.equal(world.uih_lengths, flat.uih_lengths())
    assert torch.equal(world.num_candidates, flat.num_candidates())
    assert torch.equal(world.candidate_lengths, flat.candidate_lengths())
    assert world.total_candidates == flat.num_candidates_total
    assert world.rank_offsets().tolist() == [0, 3, 3, 7]
    assert world.source_ranks().tolist() == [0, 0, 0, 2, 2, 2, 2]
    per_sample = [int(flat.select(torch.tensor([g])).content.offsets[-1]) for g in range(7)]
    assert world.content_per_sample().tolist() == per_sample
    idx = torch.tensor([5, 0])
    assert torch.equal(world.candidate_lengths_of(idx), flat.select(idx).candidate_lengths())


def test_features_are_per_sample_sums():
    batches = rank_batches([4, 2], seed=2)
    world = WorldLengths.from_batches(batches)
    feats = sample_features(world)
    assert feats.shape == (6, 5) and feats.dtype == torch.float64
    uih = world.uih_lengths.double()
    assert torch.equal(feats[:, 2], uih * uih) and torch.equal(feats[:, 0], torch.ones(6))
    assert torch.equal(batch_features(batches[0]), feats[:4].sum(0))


@pytest.mark.parametrize(
    "args",
    [
        ((2,), [1, 2, 3], [0, 0, 0], []),  # 3 lengths for 2 samples
        ((1,), [1], [2], [1]),  # 2 candidates, 1 content length
        ((1,), [-1], [0], []),  # negative length
        ((), [], [], []),  # no ranks
        ((1,), [1.5], [0], []),  # float lengths
    ],
)
def test_world_rejects_inconsistent_sizes(args):
    sizes, uih, ncand, clen = args
    dtype = torch.float32 if any(isinstance(x, float) for x in uih) else torch.int64
    with pytest.raises(ValueError):
        WorldLengths(
            sizes,
            torch.tensor(uih, dtype=dtype),
            torch.tensor(ncand, dtype=torch.int64),
            torch.tensor(clen, dtype=torch.int64),
        )


def test_equal_counts_gives_the_remainder_to_the_first_ranks():
    assert equal_counts(10, 4) == (3, 3, 2, 2)
    assert equal_counts(3, 5) == (1, 1, 1, 0, 0)
    assert equal_counts(0, 2) == (0, 0)
    with pytest.raises(ValueError):
        equal_counts(3, 0)


def test_plan_views():
    plan = Plan.from_dest(torch.tensor([1, 0, 1, 2, 0]), 3)
    assert plan.counts == (2, 2, 1)
    assert plan.order.tolist() == [1, 4, 0, 2, 3]
    assert plan.samples_of(1).tolist() == [0, 2]
    assert plan.dest().tolist() == [1, 0, 1, 2, 0]
    assert plan.digest() == Plan.from_dest(torch.tensor([1, 0, 1, 2, 0]), 3).digest()
    assert plan.digest() != Plan.from_dest(torch.tensor([0, 1, 1, 2, 0]), 3).digest()
    loads = rank_loads(plan, torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert loads.tolist() == [7.0, 4.0, 4.0]
    assert idle_fraction(loads) == pytest.approx((0 + 3 + 3) / 3 / 7)
    assert idle_fraction(torch.zeros(3)) == 0.0
    with pytest.raises(ValueError):
        Plan.from_dest(torch.tensor([0, 3]), 3)


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        (Plan(torch.tensor([0, 1, 1]), (2, 1)), "loses samples \\[2\\]"),
        (Plan(torch.tensor([0, 1]), (1, 1)), "step has 3"),
        (Plan(torch.tensor([0, 1, 2]), (3,)), "1 destinations"),
        (Plan(torch.tensor([0, 1, 3]), (2, 1)), "lie in"),
        (Plan(torch.tensor([0, 1, 2]), (3, 0), equal_counts=True), "equal counts"),
        (Plan(torch.tensor([0, 1, 2]), (4, -1)), ">= 0"),
        ("not a plan", "must return a Plan"),
    ],
)
def test_check_plan_rejects_broken_plans(plan, match):
    with pytest.raises(ValueError, match=match):
        check_plan(plan, 2, 3)


def test_check_plan_accepts_valid_plans():
    check_plan(Plan(torch.tensor([2, 0, 1]), (2, 1), equal_counts=True), 2, 3)
    check_plan(Plan(torch.zeros(0, dtype=torch.int64), (0, 0, 0), equal_counts=True), 3, 0)
    with pytest.raises(ValueError):
        Plan(torch.tensor([0.0, 1.0]), (1, 1))


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(world=worlds(), data=st.data())
def test_routing_counts_pair_up_and_match_the_plan(world, data):
    """What s sends to d is what d expects from s, at every level, and the
    received lengths are the plan's samples in arrival (global index) order."""
    w = world.world_size
    plan = reverse_partitioner(world, None)
    dest = plan.dest()
    routes = [route(world, plan, r) for r in range(w)]
    content = world.content_per_sample()
    for level in ("samples", "uih", "candidates", "content"):
        moving = {r.moving[level] for r in routes}
        assert len(moving) == 1
        for s in range(w):
            for d in range(w):
                assert routes[s].send_counts[level][d] == routes[d].recv_counts[level][s]
    src = world.source_ranks()
    for d, r in enumerate(routes):
        mine = torch.nonzero(dest == d).flatten()  # ascending global index
        assert torch.equal(r.recv_uih_lengths, world.uih_lengths[mine])
        assert torch.equal(r.recv_num_candidates, world.num_candidates[mine])
        assert r.recv_candidate_lengths.numel() == int(world.num_candidates[mine].sum())
        assert r.recv_counts["content"] == [
            int(content[mine][src[mine] == s].sum()) for s in range(w)
        ]
        if r.final_order is not None:
            assert torch.equal(mine[r.final_order], plan.samples_of(d))
        else:
            assert torch.equal(mine, plan.samples_of(d))
    r = data.draw(st.integers(0, w - 1))
    off = world.rank_offsets()
    local = dest[int(off[r]) : int(off[r + 1])]
    grouped = local if routes[r].send_order is None else local[routes[r].send_order]
    assert bool((grouped[1:] >= grouped[:-1]).all()) if grouped.numel() > 1 else True


def test_identity_plan_moves_nothing():
    world = WorldLengths.from_batches(rank_batches([2, 3], seed=3))
    plan = Plan.identity(world.batch_sizes)
    r = route(world, plan, 1)
    assert not any(r.moving.values()) and r.send_order is None and r.final_order is None
    assert r.send_counts["samples"] == [0, 3]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), b=st.integers(0, 9), data=st.data())
def test_permute_batch_equals_select(seed, b, data):
    batch = random_batch(seed=seed, batch_size=b, dense_dim=data.draw(st.sampled_from([None, 2])))
    perm = torch.tensor(data.draw(st.permutations(range(b))), dtype=torch.int64)
    assert permute_batch(batch, perm).equal(batch.select(perm))
