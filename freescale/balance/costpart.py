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
above). It is then refined by swapping sample pairs between ranks
(`refine_by_swaps`) so that, besides the predicted cost, every cost feature
(UIH tokens, squared lengths, candidates, content) is balanced too: the
fitted coefficients are noisy (balanced steps give the fit little contrast),
and a plan that equalizes every feature is balanced under *any* linear cost.
The refined plan is kept only if its predicted slowest rank is no worse than
FBS's, so under its own cost model this partitioner is never worse than FBS.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
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


def refine_by_swaps(
    dest: Tensor,
    columns: Tensor,
    weights: tuple[float, ...],
    world_size: int,
    max_swaps: int,
) -> Tensor:
    """Swap samples between rank pairs to lower sum_f w_f * sum_r (dev_rf / mean_f)^2.

    ``columns`` ([G, F]) are per-sample quantities whose per-rank sums should
    be equal, ``weights`` their importance. Swaps keep every rank's count.
    Each step takes the rank contributing most, pairs it with the rank whose
    deviations are most opposite (then the next, until a swap helps) and makes
    the single best swap of the pair. Deterministic: float64 NumPy, ties to
    the lowest indices.
    """
    x = columns.to(torch.float64).numpy()
    mean = x.sum(axis=0) / world_size
    keep = mean > 0
    x, mean = x[:, keep], mean[keep]
    u = np.asarray(weights, dtype=np.float64)[keep] / (mean * mean)
    dest_np = dest.numpy().copy()
    sums = np.zeros((world_size, x.shape[1]))
    np.add.at(sums, dest_np, x)
    for _ in range(max_swaps):
        dev = sums - mean
        a = int(np.argmax((u * dev * dev).sum(axis=1)))
        partners = np.argsort(((u * dev[a]) * dev).sum(axis=1), kind="stable")
        for b in (int(r) for r in partners if r != a):
            ia, ib = np.flatnonzero(dest_np == a), np.flatnonzero(dest_np == b)
            if not ia.size or not ib.size:
                continue
            # gain[i, j]: change of the objective when a's i and b's j swap.
            gain = np.zeros((ia.size, ib.size))
            for f in range(x.shape[1]):
                delta = x[ib, f][None, :] - x[ia, f][:, None]  # a gains it, b loses it
                gain += (2.0 * u[f]) * delta * (delta + (dev[a, f] - dev[b, f]))
            k = int(np.argmin(gain))
            if gain.flat[k] < -1e-12 * float((u * dev * dev).sum()):
                i, j = ia[k // ib.size], ib[k % ib.size]
                dest_np[i], dest_np[j] = b, a
                sums[a] += x[j] - x[i]
                sums[b] += x[i] - x[j]
                break
        else:
            break  # no pair of the worst rank improves
    return torch.from_numpy(dest_np)


@dataclass(frozen=True)
class CostPartitioner:
    """Equal-count partitioner minimizing the predicted slowest rank (module doc).

    ``karmarkar_karp``: also try balanced KK when W = 2; ``feature_weight``:
    weight of each cost feature relative to the predicted cost in the swap
    refinement (0 turns it off); ``swaps_per_rank``: its step budget.
    """

    karmarkar_karp: bool = True
    feature_weight: float = 1.0
    swaps_per_rank: int = 32

    def __call__(self, world: WorldLengths, runtime: RuntimeInfo) -> Plan:
        w = world.world_size
        costs = predicted_costs(world, runtime.cost_model)
        candidates = [lpt_plan(costs, w)]
        if self.karmarkar_karp and w == 2:
            candidates.append(karmarkar_karp_plan(costs))
        candidates.append(zigzag_plan(costs, w))
        candidates.append(zigzag_plan(world.uih_lengths, w))
        tops = [float(rank_loads(plan, costs).max()) for plan in candidates]
        best = candidates[min(range(len(tops)), key=tops.__getitem__)]
        if self.feature_weight <= 0 or w < 2:
            return best
        feats = sample_features(world)[:, 1:]  # the count column is equal already
        columns = torch.cat([costs[:, None], feats], dim=1)
        weights = (1.0,) + (self.feature_weight,) * feats.shape[1]
        dest = refine_by_swaps(best.dest(), columns, weights, w, self.swaps_per_rank * w)
        refined = Plan.from_dest(dest, w, equal=True)
        fbs_top = min(tops[-2:])  # the zig-zag candidates
        return refined if float(rank_loads(refined, costs).max()) <= fbs_top else best
