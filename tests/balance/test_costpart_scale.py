"""Cost partitioner at scale: selection, variable counts, bounds, speed."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.balance import (
    FBS,
    CostModel,
    CostModelConfig,
    CostPartitioner,
    RuntimeInfo,
    WorldLengths,
    check_plan,
    equal_counts,
    karmarkar_karp_plan,
    lpt_plan,
    rank_loads,
    sample_features,
    zigzag_plan,
)
from freescale.balance.bounds import equal_count_bound, straggler_bound, variable_count_bound
from freescale.balance.costpart import makespan, predicted_costs
from freescale.balance.refine import refine_makespan
from freescale.balance.sorting import descending_order
from freescale.testing.tolerance import sum_slack
from tests.balance._helpers import worlds

coefficients = st.tuples(*[st.sampled_from([0.0, 1e-6, 0.5, 1.0, 3.0])] * 5).filter(
    lambda c: sum(c) > 0
)


def _model(coef):
    return CostModel(CostModelConfig(prior=coef))


def _top(plan, costs) -> float:
    return float(rank_loads(plan, costs).max()) if plan.world_size else 0.0


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(world=worlds(), coef=coefficients, counts=st.sampled_from(["equal", "variable"]))
def test_selection_is_never_worse_than_any_candidate(world, coef, counts):
    """The returned plan's predicted slowest rank is <= every candidate's: the
    partitioner's own list (refined included) and the same algorithms run
    independently (FBS, LPT, KK, zig-zag on costs)."""
    model = _model(coef)
    costs = model.predict(sample_features(world))
    x, w = costs.numpy(), world.world_size
    part = CostPartitioner(counts=counts)
    # One summation (the partitioner's): another order could split exact ties by an ulp.
    top = makespan(part(world, RuntimeInfo(cost_model=model)).dest().numpy(), x, w)
    for name, dest in part.candidates(world, x):
        assert top <= makespan(dest, x, w), name
    others = [FBS()(world, RuntimeInfo()), lpt_plan(costs, w), zigzag_plan(costs, w)]
    if w == 2:
        others.append(karmarkar_karp_plan(costs))
    if counts == "variable":
        others.append(CostPartitioner()(world, RuntimeInfo(cost_model=model)))
    for other in others:
        assert top <= makespan(other.dest().numpy(), x, w)


@settings(max_examples=150, deadline=None)
@given(world=worlds(), coef=coefficients, cap=st.integers(0, 20))
def test_variable_counts_stay_within_their_bounds(world, coef, cap):
    model = _model(coef)
    w, g = world.world_size, world.total
    part = CostPartitioner(counts="variable", max_count=cap)
    plan = part(world, RuntimeInfo(cost_model=model))
    check_plan(plan, w, g)
    limit = max(-(-g // w), cap or 2 * -(-g // w))
    assert part.cap(g, w) == limit and max(plan.counts) <= limit
    if g >= w:
        assert min(plan.counts) >= 1  # no rank idles with an empty batch
    assert plan.equal_counts == (plan.counts == equal_counts(g, w))
    again = part(world, RuntimeInfo(cost_model=model))
    assert torch.equal(plan.order, again.order) and plan.counts == again.counts


@pytest.mark.numeric
@settings(max_examples=100, deadline=None)
@given(world=worlds(), coef=coefficients)
def test_loose_variable_counts_keep_the_list_scheduling_guarantee(world, coef):
    """Without a binding cap, plain LPT (a candidate) is list scheduling, so the
    plan is within one largest sample of the mean (Graham)."""
    model = _model(coef)
    costs = model.predict(sample_features(world))
    if world.total == 0:
        return
    plan = CostPartitioner(counts="variable", max_count=world.total)(
        world, RuntimeInfo(cost_model=model)
    )
    w = world.world_size
    mean, big = float(costs.sum()) / w, float(costs.max())
    # float64 loads and mean: sums of the costs in another order.
    slack = sum_slack(world.total, float(costs.sum()))
    assert _top(plan, costs) <= mean + (1 - 1 / w) * big + slack


def _brute_force(costs: list[float], w: int, equal: bool) -> float:
    best = float("inf")
    for dest in itertools.product(range(w), repeat=len(costs)):
        counts = [dest.count(r) for r in range(w)]
        if equal and sorted(counts, reverse=True) != list(equal_counts(len(costs), w)):
            continue
        loads = [sum(c for c, d in zip(costs, dest, strict=True) if d == r) for r in range(w)]
        best = min(best, max(loads))
    return best


@pytest.mark.numeric
@settings(max_examples=150, deadline=None)
@given(
    costs=st.lists(st.sampled_from([0.0, 1.0, 2.0, 5.0, 13.0, 40.0]), min_size=1, max_size=7),
    w=st.integers(1, 3),
)
def test_bounds_never_exceed_the_optimum(costs, w):
    """Brute force over every plan of a tiny step: each bound <= the optimum of
    its setting (so the bounds are bounds, not estimates)."""
    x = np.array(costs)
    opt_equal, opt_var = _brute_force(costs, w, True), _brute_force(costs, w, False)
    slack = sum_slack(len(costs), sum(costs))  # the bounds sum the costs their own way
    assert equal_count_bound(x, w) <= opt_equal + slack
    assert variable_count_bound(x, w) <= opt_var + slack
    assert opt_var <= opt_equal
    assert 0.0 <= straggler_bound(x, w, equal_count_bound(x, w)) < 1.0


def test_bounds_of_hand_worked_steps():
    """Each bound's value, worked out by hand (integers: exact). The brute force
    above only shows they are low enough; these show they are as high as the
    module doc says, i.e. which samples they pair."""
    # variable counts: max(mean, x_1, x_W + x_(W+1))
    assert variable_count_bound(np.array([5.0, 1.0, 4.0, 3.0]), 2) == 4.0 + 3.0
    assert variable_count_bound(np.array([9.0, 1.0, 1.0]), 2) == 9.0  # the largest sample
    assert variable_count_bound(np.array([3.0, 3.0, 3.0, 3.0]), 2) == 6.0  # the mean
    assert variable_count_bound(np.array([3.0, 2.0]), 3) == 3.0  # G <= W: no pair
    # equal counts, n = 3 per rank: m = 1 gives x_1 + s(2) = 10 + 1 + 1 (the optimum)
    x = np.array([1.0, 10.0, 1.0, 9.0, 1.0, 1.0])
    assert equal_count_bound(x, 2) == 12.0
    assert straggler_bound(x, 2, 12.0) == 1.0 - 11.5 / 12.0


def _seqrec(g: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    body = np.maximum(np.floor(rng.lognormal(np.log(6), 1.0, g)), 1)
    tail = rng.random(g) < 0.003  # as benchmarks/partition.py's "seqrec"
    body[tail] = np.floor(30 * rng.random(int(tail.sum())) ** (-1 / 1.2))
    return torch.from_numpy(np.minimum(body, 1000).astype(np.int64))


def _world(uih: torch.Tensor, w: int) -> WorldLengths:
    g = uih.numel()
    z = torch.zeros(g, dtype=torch.int64)
    return WorldLengths((g // w,) * w, uih, z, torch.zeros(0, dtype=torch.int64))


TRUTH = _model((0.0, 4096.0, 1.0, 0.0, 0.0))


@pytest.mark.parametrize("w", [8, 64])
@pytest.mark.parametrize("counts", ["equal", "variable"])
def test_heavy_tails_come_within_the_target_of_the_bound(w, counts):
    world = _world(_seqrec(128 * w, w), w)
    costs = TRUTH.predict(sample_features(world))
    x = costs.numpy()
    plan = CostPartitioner(counts=counts)(world, RuntimeInfo(cost_model=TRUTH))
    bound = equal_count_bound(x, w) if counts == "equal" else variable_count_bound(x, w)
    got = 1.0 - float(costs.sum()) / w / _top(plan, costs)
    assert 100 * got <= 1.25 * 100 * straggler_bound(x, w, bound) + 0.5
    assert _top(plan, costs) < _top(FBS()(world, RuntimeInfo()), costs)


@pytest.mark.numeric
@settings(max_examples=100, deadline=None)
@given(world=worlds(), coef=coefficients)
def test_refinement_never_raises_the_makespan_and_keeps_counts(world, coef):
    costs = _model(coef).predict(sample_features(world)).numpy()
    w = world.world_size
    start = zigzag_plan(torch.from_numpy(costs), w).dest().numpy()
    out = refine_makespan(start, costs, w, budget=16)
    # Up to summation order: loads are updated incrementally inside, one
    # exchange (two more terms) at a time, at most `budget` of them.
    slack = sum_slack(costs.size + 2 * 16, float(np.abs(costs).sum()))
    assert makespan(out, costs, w) <= makespan(start, costs, w) + slack
    assert np.array_equal(np.bincount(out, minlength=w), np.bincount(start, minlength=w))


def test_refinement_applies_no_exchange_without_a_real_gain():
    """Loads 7 + 1e-13 and 6: every exchange lowers the slowest rank by 1e-13 at
    most, summation-order noise, not a gain. The plan comes back unchanged
    (applying such exchanges would spend the budget on noise)."""
    costs = np.array([6.0, 1.0 + 1e-13, 5.0, 1.0])
    start = np.array([0, 0, 1, 1])
    out = refine_makespan(start, costs, 2, budget=16, tolerance=0.0)
    assert np.array_equal(out, start)
    # a real gain is taken: loads 8 and 5 become 7 and 6 (the best equal-count plan)
    costs = np.array([6.0, 2.0, 4.0, 1.0])
    assert makespan(refine_makespan(start, costs, 2, budget=16), costs, 2) == 7.0


@settings(max_examples=100, deadline=None)
@given(world=worlds(), coef=coefficients)
def test_predicted_costs_are_bit_identical_to_the_model(world, coef):
    model = _model(coef)
    assert torch.equal(predicted_costs(world, model), model.predict(sample_features(world)))


@pytest.mark.parametrize("n", [10, 5000, 70_000])
def test_fast_descending_order(n):
    rng = np.random.default_rng(n)
    ints = rng.integers(0, 50, n)  # many ties: must match a stable sort exactly
    ref = torch.sort(torch.from_numpy(ints), descending=True, stable=True).indices.numpy()
    assert np.array_equal(descending_order(ints), ref)
    floats = rng.lognormal(0, 3, n)
    order = descending_order(floats)
    assert np.array_equal(np.sort(order), np.arange(n))
    step = floats.max() / 2**32  # quantization: order holds up to one key step
    assert (np.diff(floats[order]) <= step).all()
