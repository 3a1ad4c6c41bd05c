"""Shared builders and checks for the balancer tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from hypothesis import strategies as st

from freescale.balance import Plan, WorldLengths, check_plan
from freescale.jagged import SampleBatch
from freescale.testing.batches import random_batch

lengths = st.one_of(st.just(0), st.integers(0, 8), st.integers(0, 21_000))


@st.composite
def worlds(draw: st.DrawFn, max_world: int = 8, max_total: int = 64) -> WorldLengths:
    """Random world: W in [1, max_world], G in [0, max_total] split unevenly
    (empty ranks and G < W included), zero lengths and ties likely."""
    w = draw(st.integers(1, max_world))
    g = draw(st.integers(0, max_total))
    cuts = sorted(draw(st.lists(st.integers(0, g), min_size=w - 1, max_size=w - 1)))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, g], strict=True)]
    uih = draw(st.lists(lengths, min_size=g, max_size=g))
    ncand = draw(st.lists(st.integers(0, 3), min_size=g, max_size=g))
    clen = draw(st.lists(st.integers(0, 5), min_size=sum(ncand), max_size=sum(ncand)))
    return WorldLengths(
        tuple(sizes),
        torch.tensor(uih, dtype=torch.int64),
        torch.tensor(ncand, dtype=torch.int64),
        torch.tensor(clen, dtype=torch.int64),
    )


def rank_batches(sizes: Sequence[int], seed: int, max_uih: int = 40) -> list[SampleBatch]:
    """Per-rank batches of one global step with globally unique sample ids
    (rank-major), so global index g has sample id ``seed * 1000 + g``."""
    out, start = [], seed * 1000
    for r, b in enumerate(sizes):
        out.append(
            random_batch(seed * 97 + r, b, max_uih=max_uih, max_candidates=3, first_sample_id=start)
        )
        start += b
    return out


def check_balanced(
    inputs: Sequence[SampleBatch], plan: Plan, outputs: Sequence[SampleBatch]
) -> None:
    """Every output is exactly the plan's selection of the global batch."""
    world = SampleBatch.concat(list(inputs))
    check_plan(plan, len(inputs), world.batch_size)
    assert [o.batch_size for o in outputs] == list(plan.counts)
    for d, out in enumerate(outputs):
        out.validate()
        assert out.equal(world.select(plan.samples_of(d))), f"rank {d} got the wrong samples"
    got = torch.sort(torch.cat([o.sample_id for o in outputs])).values
    assert torch.equal(got, torch.sort(world.sample_id).values)


def reverse_partitioner(world: WorldLengths, runtime) -> Plan:
    """A user partitioner: sample g goes to rank (G - 1 - g) % W, each rank
    holding its samples in *descending* global index (exercises plan order)."""
    g, w = world.total, world.world_size
    order_parts = []
    dest = (g - 1 - torch.arange(g)) % w
    for d in range(w):
        order_parts.append(torch.nonzero(dest == d).flatten().flip(0))
    order = torch.cat(order_parts) if order_parts else torch.zeros(0, dtype=torch.int64)
    counts = torch.bincount(dest, minlength=w).tolist()
    return Plan(order, tuple(counts))
