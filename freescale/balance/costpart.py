"""Cost-model partitioner (beyond the paper): minimal predicted slowest rank.

Per-sample costs come from the online-fitted `CostModel` in ``runtime`` (or
its prior, cost = UIH length, before any measurement). The partitioner builds
several candidate plans and returns the one whose slowest rank has the
smallest predicted cost (ties: the earlier candidate below), so under its own
model it is never worse than any of them, FBS included:

- ``lpt``: projected LPT with per-rank caps (`freescale.balance.lpt`);
- ``kk`` (W = 2): balanced Karmarkar–Karp differencing: pair neighbours of
  the sorted list, then repeatedly merge the two partial partitions with the
  largest differences, heavy side of one with the light side of the other;
- ``zigzag-cost`` and ``fbs``: the FBS zig-zag on predicted costs and on UIH
  lengths;
- ``refined``: the best of the above improved by swaps of samples between
  the slowest rank and the lightest ones (`freescale.balance.refine`), within
  a budget of pair searches derived from W.

(An earlier version refined toward equal sums of every cost feature and kept
the result when it beat FBS, even when its own LPT plan was far better; it
cost O(B²) per swap. The selection is now strictly by the model.)

``counts="equal"`` (default) keeps `equal_counts` (the first G mod W ranks
get one sample more). ``counts="variable"`` lets ranks hold different counts,
which heavy-tailed steps need (a rank with one huge sample should hold few
others), between 1 (when G >= W) and ``max_count`` (0: twice the equal
count; never below it), so memory stays bounded. Its candidates add plain
LPT under the cap and ``refined-variable``, the best plan so far refined by
swaps and moves; the equal-count plans (refined included) stay candidates,
so variable counts are never worse under the model than equal counts. The
loss is normalized by the global candidate count, so uneven local batches do
not change the math.

Planning time (one core): every step is vectorized NumPy except the exact
heap steps for the W largest samples and the KK loop at W = 2; the refinement
budget is a step count, not a time, so every rank computes the same plan.
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from freescale.balance.cost import CostModel
from freescale.balance.fbs import descending_order, zigzag_ranks
from freescale.balance.lpt import projected_lpt
from freescale.balance.plan import Plan, equal_counts
from freescale.balance.refine import refine_makespan
from freescale.balance.runtime import RuntimeInfo
from freescale.balance.sorting import descending_order as fast_descending_order
from freescale.balance.sorting import group_by_dest
from freescale.balance.world import WorldLengths

COUNTS = ("equal", "variable")


EXACT_HEAD = 1024  # samples placed by exact heap steps (~0.7 µs each) before grouping


def lpt_dest(
    x: np.ndarray, room: np.ndarray, project: bool, order: np.ndarray | None = None
) -> np.ndarray:
    """Per-sample destinations of projected LPT (``project``) or plain LPT under caps;
    ``order``: `descending_order` of ``x`` if already known."""
    order = fast_descending_order(x) if order is None else order
    w = room.size
    head = max(w, min(x.size, EXACT_HEAD))
    dest = np.empty(x.size, dtype=np.int64)
    dest[order] = projected_lpt(
        x[order], room, head=head, min_group=max(1, w // 2), project=project
    )
    return dest


def lpt_plan(costs: Tensor, world_size: int) -> Plan:
    """Projected LPT with equal counts (`freescale.balance.lpt`)."""
    room = np.asarray(equal_counts(costs.numel(), world_size), dtype=np.int64)
    dest = lpt_dest(costs.to(torch.float64).numpy(), room, project=True)
    return _plan(dest, world_size, equal=True)


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
    """``[G]`` predicted per-sample costs (the prior model when ``model`` is None).

    The same float64 operations, in the same order, as
    ``model.predict(sample_features(world))``, so bit-identical to it, but
    only the columns with a non-zero coefficient are built (the content sums
    and the [G, 5] stack cost more than the rest of a W = 8 plan)."""
    coef = (model or CostModel()).coefficients
    uih = world.uih_lengths.to(torch.float64)
    columns = (
        lambda: torch.ones_like(uih),
        lambda: uih,
        lambda: uih * uih,
        lambda: world.num_candidates.to(torch.float64),
        lambda: world.content_per_sample().to(torch.float64),
    )
    out = torch.zeros(world.total, dtype=torch.float64)
    for c, column in zip(coef, columns, strict=True):
        if c:
            out += column() * c
    return out


@functools.lru_cache(maxsize=16)
def _zigzag_ranks(num: int, world_size: int) -> np.ndarray:
    ranks = zigzag_ranks(num, world_size).numpy()
    ranks.setflags(write=False)  # shared by every call with this (G, W)
    return ranks


def zigzag_dest(keys: np.ndarray, world_size: int, order: np.ndarray | None = None) -> np.ndarray:
    """The FBS zig-zag destinations for sort ``keys`` (largest first, ties by index)."""
    order = fast_descending_order(keys) if order is None else order
    dest = np.empty(keys.size, dtype=np.int64)
    dest[order] = _zigzag_ranks(keys.size, world_size)
    return dest


def makespan(dest: np.ndarray, costs: np.ndarray, world_size: int) -> float:
    """Predicted cost of the slowest rank."""
    loads = np.bincount(dest, weights=costs, minlength=world_size)
    return float(loads.max()) if loads.size else 0.0


def _plan(dest: np.ndarray, world_size: int, equal: bool) -> Plan:
    counts = np.bincount(dest, minlength=world_size).tolist()
    return Plan(torch.from_numpy(group_by_dest(dest, world_size)), tuple(counts), equal)


def refine_budget(world_size: int) -> int:
    """Pair searches the refinement may make: W / 8 within [8, 64]. One search is
    O(B log B) for B samples per rank, ~50 µs at B = 128, so this keeps the
    refinement near 3 ms at W = 512 and 0.4 ms at W = 8 (measured with
    benchmarks/partition.py, removed after aca6152)."""
    return min(64, max(8, world_size // 8))


@dataclass(frozen=True)
class CostPartitioner:
    """Partitioner minimizing the predicted slowest rank (module doc).

    ``counts``: "equal" | "variable"; ``max_count``: variable counts' per-rank
    cap (0: twice the equal count); ``karmarkar_karp``: also try balanced KK
    when W = 2; ``refine``: run the swap refinement.
    """

    counts: str = "equal"
    max_count: int = 0
    karmarkar_karp: bool = True
    refine: bool = True

    def __post_init__(self) -> None:
        if self.counts not in COUNTS:
            raise ValueError(f"counts must be one of {COUNTS}, got {self.counts!r}")
        if self.max_count < 0:
            raise ValueError(f"max_count must be >= 0, got {self.max_count}")

    def cap(self, total: int, world_size: int) -> int:
        """Largest per-rank count allowed with variable counts."""
        even = -(-total // world_size)
        return max(even, self.max_count or 2 * even)

    def candidates(self, world: WorldLengths, costs: np.ndarray) -> list[tuple[str, np.ndarray]]:
        """Every candidate's per-sample destinations, in tie-breaking order: the
        equal-count ones (refined first), then with variable counts their own
        (refined first) ahead of them, so every equal-count plan stays a candidate."""
        w, g = world.world_size, world.total
        room = np.asarray(equal_counts(g, w), dtype=np.int64)
        order = fast_descending_order(costs)  # shared by LPT and the zig-zag
        out = [("lpt", lpt_dest(costs, room, project=True, order=order))]
        if self.karmarkar_karp and w == 2:
            out.append(("kk", karmarkar_karp_plan(torch.from_numpy(costs)).dest().numpy()))
        out.append(("zigzag-cost", zigzag_dest(costs, w, order)))
        out.append(("fbs", zigzag_dest(world.uih_lengths.numpy(), w)))
        if self.refine and w > 1 and g:
            out.insert(0, ("refined", refine_makespan(self._best(out, costs, w), costs, w,
                                                      refine_budget(w))))  # fmt: skip
        if self.counts == "variable":
            cap = np.full(w, self.cap(g, w), dtype=np.int64)
            mine = [("lpt-variable", lpt_dest(costs, cap, project=False, order=order))]
            if self.refine and w > 1 and g:
                start = self._best(mine + out, costs, w)
                lo = 1 if g >= w else 0
                dest = refine_makespan(start, costs, w, refine_budget(w), lo, self.cap(g, w))
                mine.insert(0, ("refined-variable", dest))
            out = mine + out
        return out

    @staticmethod
    def _best(found: list[tuple[str, np.ndarray]], costs: np.ndarray, w: int) -> np.ndarray:
        return min(found, key=lambda c: makespan(c[1], costs, w))[1]

    def __call__(self, world: WorldLengths, runtime: RuntimeInfo) -> Plan:
        w = world.world_size
        costs = predicted_costs(world, runtime.cost_model).numpy()
        if w == 1 or world.total == 0:
            return _plan(np.zeros(world.total, dtype=np.int64), w, equal=True)
        found = self.candidates(world, costs)
        tops = [makespan(dest, costs, w) for _, dest in found]
        dest = found[int(np.argmin(tops))][1]  # argmin: the first of equal tops
        counts = np.bincount(dest, minlength=w)
        return _plan(dest, w, equal=tuple(counts.tolist()) == equal_counts(world.total, w))
