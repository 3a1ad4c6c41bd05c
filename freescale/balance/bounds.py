"""Lower bounds on the slowest rank's cost, to say how far a plan is from optimal.

Costs ``x`` (one per sample, >= 0) go to W ranks; the makespan is the largest
per-rank sum. Write x_1 >= x_2 >= ... >= x_G, S_m = x_1 + ... + x_m, s(k) for
the sum of the k *smallest* costs, and n = floor(G / W), the fewest samples a
rank holds under equal counts.

Variable counts (`variable_count_bound`): the makespan is at least

- the mean ``S_G / W`` (some rank is at least average);
- ``x_1`` (the largest sample sits somewhere);
- ``x_W + x_(W+1)`` when G > W: of the W + 1 largest samples two share a rank
  (pigeonhole), and any two of them cost at least the two smallest of them.

A cap on per-rank counts only removes plans, so these stay bounds with it.

Equal counts (`equal_count_bound`): every rank holds at least n samples, so
for each m in 1..min(W, G) either

- the m largest samples sit on m distinct ranks, which hold at least m·n
  samples in all, m of them the m largest and m·(n − 1) others costing at
  least s(m·(n − 1)): the busiest of those m ranks is at least
  ``(S_m + s(m(n − 1))) / m``; or
- two of them share a rank, which costs at least ``x_(m−1) + x_m + s(n − 2)``.

The bound is the mean and, over m, the smaller of the two cases (for m = 1
only the first: ``x_1 + s(n − 1)``). It is at least the variable-count bound's
mean and largest item, and much higher when a few huge samples each force
n − 1 companions onto their rank, which is what heavy tails do.

`straggler_bound` turns a makespan bound into the straggler % bound
``1 − mean / bound`` (the straggler metric of ``freescale.observe.metrics``; the mean is fixed by
the samples).
"""

from __future__ import annotations

import numpy as np


def _sorted_desc(costs: np.ndarray) -> np.ndarray:
    return np.sort(np.asarray(costs, dtype=np.float64))[::-1]


def variable_count_bound(costs: np.ndarray, world_size: int) -> float:
    """max(mean, x_1, x_W + x_(W+1)) (module doc)."""
    x = _sorted_desc(costs)
    if not x.size:
        return 0.0
    bound = max(float(x.sum()) / world_size, float(x[0]))
    if x.size > world_size:
        bound = max(bound, float(x[world_size - 1] + x[world_size]))
    return bound


def equal_count_bound(costs: np.ndarray, world_size: int) -> float:
    """The equal-count bound of the module doc (counts floor(G/W) or one more)."""
    x = _sorted_desc(costs)
    g = x.size
    if not g:
        return 0.0
    n = g // world_size
    top = np.concatenate([[0.0], np.cumsum(x)])  # top[m] = S_m
    small = np.concatenate([[0.0], np.cumsum(x[::-1])])  # small[k] = s(k)
    m = np.arange(1, min(world_size, g) + 1)
    distinct = (top[m] + small[np.minimum(m * max(n - 1, 0), g)]) / m
    shared = np.full(m.size, np.inf)
    shared[1:] = x[m[1:] - 2] + x[m[1:] - 1] + small[max(n - 2, 0)]
    return max(float(x.sum()) / world_size, float(np.minimum(distinct, shared).max()))


def straggler_bound(costs: np.ndarray, world_size: int, makespan_bound: float) -> float:
    """Lowest straggler fraction (0..1) any plan can reach given a makespan bound."""
    if makespan_bound <= 0:
        return 0.0
    return max(0.0, 1.0 - float(np.sum(costs)) / world_size / makespan_bound)
