"""Local search on the slowest rank: swaps and moves, bounded by a step budget.

Starting from a plan's per-sample destinations, each step takes the rank with
the highest load h (ties: lower rank) and tries partners l from the lightest
up. For a pair with gap 2t = load_h − load_l, giving away a sample of cost a
and taking one of cost b lowers the pair's maximum iff 0 < a − b < 2t, best
when a − b is nearest t. So for every sample of h a binary search among l's
sorted costs finds the two nearest partners; a *move* (b = 0) is also tried
when counts may vary (h keeps at least ``min_count``, l stays within
``max_count``). The best candidate that lowers the pair's maximum is applied;
otherwise the next partner is tried. The search stops when h cannot improve
with any of ``partners`` partners, when it is within ``tolerance`` of the
mean, or after ``budget`` pair searches.

The budget is a count, never a time: a wall-clock budget would make the plan
depend on each rank's speed, and every rank must compute the same plan. The
caller derives it from W (one step is O(B log B) for B samples per rank, tens
of microseconds); it was calibrated with benchmarks/partition.py (removed after
aca6152).
"""

from __future__ import annotations

import numpy as np

from freescale.balance.sorting import group_by_dest


def _best_exchange(
    xh: np.ndarray, xl: np.ndarray, top: float, low: float, allow_move: bool
) -> tuple[float, int, int]:
    """(new pair maximum, index in h, index in l or -1 for a move) of the best
    exchange from h (load ``top``) to l (load ``low``); maximum inf when none helps."""
    half = (top - low) / 2.0
    best = (np.inf, -1, -1)
    if xl.size:
        order = np.argsort(xl, kind="stable")
        xs = xl[order]
        pos = np.searchsorted(xs, xh - half)
        for p in (np.maximum(pos - 1, 0), np.minimum(pos, xs.size - 1)):
            d = xh - xs[p]
            peak = np.where((d > 0) & (d < 2 * half), np.maximum(top - d, low + d), np.inf)
            i = int(np.argmin(peak))
            if peak[i] < best[0]:
                best = (float(peak[i]), i, int(order[p[i]]))
    if allow_move:
        peak = np.where((xh > 0) & (xh < 2 * half), np.maximum(top - xh, low + xh), np.inf)
        i = int(np.argmin(peak))
        if peak[i] < best[0]:
            best = (float(peak[i]), i, -1)
    return best


def refine_makespan(
    dest: np.ndarray,
    costs: np.ndarray,
    world_size: int,
    budget: int,
    min_count: int | None = None,
    max_count: int | None = None,
    partners: int = 4,
    tolerance: float = 1e-4,
) -> np.ndarray:
    """``dest`` improved by exchanges, at most ``budget`` pair searches (module doc). Counts stay
    fixed unless both ``min_count`` and ``max_count`` are given. Stops early once
    the slowest rank is within ``tolerance`` (relative) of the mean."""
    dest = dest.copy()
    loads = np.bincount(dest, weights=costs, minlength=world_size)
    sizes = np.bincount(dest, minlength=world_size)
    members = _Members(group_by_dest(dest, world_size), sizes)
    moves = min_count is not None and max_count is not None
    enough = float(loads.mean()) * (1.0 + tolerance)
    partners = min(partners, world_size - 1)
    while budget > 0:
        h = int(np.argmax(loads))
        if loads[h] <= enough:
            break
        light = np.argpartition(loads, partners)[: partners + 1]
        light = light[np.lexsort((light, loads[light]))]  # lightest first, ties: lower rank
        done = False
        for l in light.tolist():
            if l == h or loads[l] >= loads[h]:
                break
            budget -= 1
            mh, ml = members.of(h), members.of(l)
            allow = moves and mh.size > min_count and ml.size < max_count
            peak, i, j = _best_exchange(
                costs[mh], costs[ml], float(loads[h]), float(loads[l]), allow
            )
            if peak < loads[h] * (1.0 - 1e-12):  # a real gain, not summation-order noise
                _apply(dest, costs, loads, members, h, l, i, j)
                done = True
                break
        if not done:
            break
    return dest


class _Members:
    """Each rank's sample indices: views into one grouped order until a move
    changes a rank's size (then an array of its own)."""

    def __init__(self, order: np.ndarray, sizes: np.ndarray) -> None:
        self.order = order
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])
        self.own: dict[int, np.ndarray] = {}

    def of(self, r: int) -> np.ndarray:
        if r in self.own:
            return self.own[r]
        return self.order[self.offsets[r] : self.offsets[r + 1]]

    def set(self, r: int, samples: np.ndarray) -> None:
        self.own[r] = samples


def _apply(
    dest: np.ndarray,
    costs: np.ndarray,
    loads: np.ndarray,
    members: _Members,
    h: int,
    l: int,
    i: int,
    j: int,
) -> None:
    mh, ml = members.of(h), members.of(l)
    gi = int(mh[i])
    if j < 0:  # move
        members.set(h, np.delete(mh, i))
        members.set(l, np.append(ml, gi))
        dest[gi] = l
        loads[h] -= costs[gi]
        loads[l] += costs[gi]
        return
    gj = int(ml[j])
    mh[i], ml[j] = gj, gi  # in place: views of the grouped order or own arrays
    dest[gi], dest[gj] = l, h
    loads[h] += costs[gj] - costs[gi]
    loads[l] += costs[gi] - costs[gj]
