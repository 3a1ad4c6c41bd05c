"""Cost-model partitioner (beyond the paper): equal counts, minimal predicted makespan.

Per-sample costs come from the online-fitted `CostModel` in ``runtime`` (or
its prior, cost = UIH length, before any measurement). Samples are then
placed with equal counts (`freescale.balance.plan.equal_counts`) by:

- LPT: longest predicted cost first, each onto the least-loaded rank that
  still has room (ties: lower rank; equal costs: lower global index);
- for W = 2, balanced Karmarkar–Karp differencing: pair neighbours of the
  sorted list, then repeatedly merge the two partial partitions with the
  largest differences, the heavy side of one with the light side of the
  other; every pair gives one sample to each side, so counts stay equal;
- zig-zag (FBS) on the predicted costs and on the UIH lengths.

The plan with the smallest maximum predicted rank cost wins (ties: the order
above). Keeping FBS among the candidates guarantees that, under its own cost
model, this partitioner is never worse than FBS.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch import Tensor

from freescale.balance.cost import CostModel
from freescale.balance.fbs import descending_order, zigzag_plan
from freescale.balance.plan import Plan, equal_counts, rank_loads
from freescale.balance.runtime import RuntimeInfo
from freescale.balance.world import WorldLengths, sample_features


def lpt_plan(costs: Tensor, world_size: int) -> Plan:
    """Longest-processing-time-first with per-rank capacities `equal_counts`."""
    room = list(equal_counts(costs.numel(), world_size))
    cost = costs.to(torch.float64).tolist()
    heap = [(0.0, d) for d in range(world_size) if room[d] > 0]
    dest = [0] * len(cost)
    for g in descending_order(costs).tolist():
        load, d = heapq.heappop(heap)
        dest[g] = d
        room[d] -= 1
        if room[d]:
            heapq.heappush(heap, (load + cost[g], d))
    return Plan.from_dest(torch.tensor(dest, dtype=torch.int64), world_size, equal=True)


def karmarkar_karp_plan(costs: Tensor) -> Plan:
    """Balanced two-way differencing (W = 2, equal counts; rank 0 gets the extra
    sample when G is odd)."""
    cost = costs.to(torch.float64).tolist()
    items = descending_order(costs).tolist()
    if len(items) % 2:
        items.append(-1)  # a zero-cost dummy, smallest of all
    heap: list[tuple[float, int, list[int], list[int]]] = []
    for k in range(0, len(items), 2):
        a, b = items[k], items[k + 1]
        diff = cost[a] - (cost[b] if b >= 0 else 0.0)
        heap.append((-diff, k, [a], [b]))
    heapq.heapify(heap)
    seq = len(items)
    while len(heap) > 1:
        d1, _, heavy1, light1 = heapq.heappop(heap)
        d2, _, heavy2, light2 = heapq.heappop(heap)
        # -d1 >= -d2: heavy1 + light2 stays the heavy side, by -d1 - (-d2).
        heapq.heappush(heap, (d1 - d2, seq, heavy1 + light2, light1 + heavy2))
        seq += 1
    dest = torch.zeros(len(cost), dtype=torch.int64)
    if heap:
        _, _, heavy, light = heap[0]
        side1 = heavy if -1 in heavy else light  # rank 0: the side without the dummy
        dest[torch.tensor([g for g in side1 if g >= 0], dtype=torch.int64)] = 1
    return Plan.from_dest(dest, 2, equal=True)


def predicted_costs(world: WorldLengths, model: CostModel | None) -> Tensor:
    """``[G]`` predicted per-sample costs (the prior model when ``model`` is None)."""
    return (model or CostModel()).predict(sample_features(world))


@dataclass(frozen=True)
class CostPartitioner:
    """Equal-count partitioner minimizing the predicted slowest rank (module doc).

    ``karmarkar_karp``: also try balanced KK when W = 2.
    """

    karmarkar_karp: bool = True

    def __call__(self, world: WorldLengths, runtime: RuntimeInfo) -> Plan:
        w = world.world_size
        costs = predicted_costs(world, runtime.cost_model)
        candidates = [lpt_plan(costs, w)]
        if self.karmarkar_karp and w == 2:
            candidates.append(karmarkar_karp_plan(costs))
        candidates.append(zigzag_plan(costs, w))
        candidates.append(zigzag_plan(world.uih_lengths, w))
        best, best_max = candidates[0], float("inf")
        for plan in candidates:
            top = float(rank_loads(plan, costs).max())
            if top < best_max:
                best, best_max = plan, top
        return best
