"""Variable Batch Size (VBS) partitioning and AutoTune (paper §4.1).

VBS weighs every sample by L^alpha (L = UIH length), sorts the samples longest
first (ties by global index) and cuts the sorted list into W contiguous
segments of approximately equal weight, segment d going to rank d. Ranks get
different sample counts, but each batch holds samples of similar length (low
padding sparsity, even per-sample work inside kernels).

L^alpha only approximates compute time. `AutoTune` corrects it from
measurements: each rank's target share of the total weight moves by the
difference between that rank's measured execution time and the mean, so a
rank that ran long gets a smaller segment next time. The shares reach VBS
through ``RuntimeInfo.shares``. Because segment d always holds the d-th
longest slice of the sorted step, per-rank shares also absorb systematic
errors of alpha, not only slow hardware.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from freescale.balance.fbs import descending_order
from freescale.balance.plan import Plan
from freescale.balance.runtime import RuntimeInfo
from freescale.balance.world import WorldLengths


def segment_bounds(weights: Tensor, shares: Sequence[float]) -> list[int]:
    """``W + 1`` cut points into ``weights`` (sorted samples) so that segment d's
    weight is as close as possible to ``shares[d]`` of the total.

    Each cut is the prefix position nearest its target (the lower on a tie);
    then cuts are forced strictly increasing so that every rank gets at least
    one sample when there are at least W samples (with fewer, ranks 0..G-1 get
    one sample each).
    """
    w, g = len(shares), weights.numel()
    if g < w:
        return [min(d, g) for d in range(w + 1)]
    prefix = torch.zeros(g + 1, dtype=torch.float64)
    torch.cumsum(weights.to(torch.float64), 0, out=prefix[1:])
    share = torch.tensor(shares, dtype=torch.float64)
    targets = torch.cumsum(share / share.sum(), 0)[:-1] * prefix[-1]
    hi = torch.searchsorted(prefix, targets).clamp(max=g)
    lo = (hi - 1).clamp(min=0)
    nearer_lo = (targets - prefix[lo]) <= (prefix[hi] - targets)
    cuts = torch.where(nearer_lo, lo, hi).tolist()
    bounds = [0]
    for d, cut in enumerate(cuts, start=1):
        bounds.append(min(max(int(cut), bounds[-1] + 1), g - (w - d)))
    bounds.append(g)
    return bounds


@dataclass(frozen=True)
class VBS:
    """Variable-batch-size partitioner with weights L^alpha (``alpha >= 0``).

    alpha = 1 balances UIH tokens; attention-dominated models want ~2. Uses
    ``runtime.shares`` (AutoTune) when given, equal shares otherwise.
    """

    alpha: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 4.0:
            raise ValueError(f"alpha must lie in [0, 4], got {self.alpha}")

    def __call__(self, world: WorldLengths, runtime: RuntimeInfo) -> Plan:
        w = world.world_size
        shares = runtime.shares if runtime.shares is not None else (1.0,) * w
        if len(shares) != w:
            raise ValueError(f"runtime.shares has {len(shares)} entries, world size is {w}")
        sorted_idx = descending_order(world.uih_lengths)
        weights = world.uih_lengths[sorted_idx].to(torch.float64).pow(self.alpha)
        if not float(weights.sum()) > 0:  # all-empty step: split by count
            weights = torch.ones_like(weights)
        bounds = torch.tensor(segment_bounds(weights, shares), dtype=torch.int64)
        dest = torch.empty(world.total, dtype=torch.int64)
        dest[sorted_idx] = torch.repeat_interleave(torch.arange(w), bounds.diff())
        return Plan.from_dest(dest, w)


@dataclass(frozen=True)
class AutoTuneConfig:
    """``gain``: fraction of the relative time difference corrected per update
    (kept well under 1: the balancer runs a step or two ahead, and a delayed
    proportional controller oscillates at high gain); ``max_change``: cap on
    one update's relative share change; ``min_share``: floor of a share as a
    fraction of the equal share 1/W."""

    gain: float = 0.3
    max_change: float = 0.25
    min_share: float = 0.1

    def __post_init__(self) -> None:
        if not 0.0 < self.gain <= 1.0:
            raise ValueError(f"gain must lie in (0, 1], got {self.gain}")
        if not 0.0 < self.max_change < 1.0:
            raise ValueError(f"max_change must lie in (0, 1), got {self.max_change}")
        if not 0.0 < self.min_share <= 1.0:
            raise ValueError(f"min_share must lie in (0, 1], got {self.min_share}")


class AutoTune:
    """Per-rank target shares of the step's total weight, tuned from measured times.

    ``update(times)``: share_d *= 1 - gain * (t_d - mean) / mean (clipped to
    ``1 ± max_change``), renormalized to sum 1 with a floor of ``min_share / W``.
    Every rank must call it with the same (all-gathered) times so that all
    ranks keep equal shares.
    """

    def __init__(self, world_size: int, config: AutoTuneConfig | None = None) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.config = config or AutoTuneConfig()
        self._shares = np.full(world_size, 1.0 / world_size)

    @property
    def shares(self) -> tuple[float, ...]:
        return tuple(float(s) for s in self._shares)

    def state_dict(self) -> dict[str, list[float]]:
        return {"shares": self._shares.tolist()}

    def load_state_dict(self, state: dict[str, list[float]]) -> None:
        shares = np.asarray(state["shares"], dtype=np.float64)
        if shares.size != self.world_size:
            raise ValueError(
                f"AutoTune state has {shares.size} shares, world size {self.world_size}"
            )
        self._shares = shares

    def reset(self) -> None:
        self._shares = np.full(self.world_size, 1.0 / self.world_size)

    def update(self, rank_times_ms: Sequence[float]) -> tuple[float, ...]:
        """Move the shares by one measurement; returns the new shares."""
        times = np.asarray(rank_times_ms, dtype=np.float64).reshape(-1)
        if times.size != self.world_size:
            raise ValueError(f"need {self.world_size} rank times, got {times.size}")
        if not np.isfinite(times).all() or (times < 0).any():
            raise ValueError(f"rank times must be finite and >= 0, got {times.tolist()}")
        mean = float(times.mean())
        if mean <= 0.0:
            return self.shares
        cfg = self.config
        factor = np.clip(
            1.0 - cfg.gain * (times - mean) / mean, 1 - cfg.max_change, 1 + cfg.max_change
        )
        self._shares = _floored(self._shares * factor, cfg.min_share / self.world_size)
        return self.shares


def _floored(shares: np.ndarray, floor: float) -> np.ndarray:
    """``shares`` normalized to sum 1 with every entry >= ``floor`` (W·floor <= 1):
    floored entries are fixed and the rest rescaled, until nothing changes."""
    shares = shares / shares.sum()
    low = np.zeros(shares.size, dtype=bool)
    for _ in range(shares.size):
        new_low = low | (shares < floor)
        if new_low.sum() == low.sum():
            break
        low = new_low
        free = 1.0 - floor * low.sum()
        rest = shares[~low].sum()
        shares = np.where(low, floor, shares * (free / rest if rest > 0 else 0.0))
    return shares
