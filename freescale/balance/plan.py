"""`Plan`: where every sample of a global step goes, and in which order it lands.

A plan is what a partitioner returns. ``order`` lists all G global sample
indices (rank-major, see `freescale.balance.world`) *destination-major*:
destination 0's samples in the order its balanced batch holds them, then
destination 1's, and so on; ``counts[d]`` is how many destination d gets.
Destination-major order makes "nothing lost, nothing duplicated" a property of
one tensor (it is a permutation of ``range(G)``), and it fixes the order in
which each destination concatenates what it receives.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def equal_counts(total: int, world_size: int) -> tuple[int, ...]:
    """The equal-count split of ``total`` samples: the first ``total % W`` ranks
    get one more than the others (``total // W``)."""
    if world_size < 1 or total < 0:
        raise ValueError(f"need world_size >= 1 and total >= 0, got {world_size}, {total}")
    base, extra = divmod(total, world_size)
    return tuple(base + (1 if d < extra else 0) for d in range(world_size))


@dataclass(frozen=True)
class Plan:
    """Destination-major sample order plus per-destination counts.

    ``equal_counts`` is a promise the partitioner makes (FBS and the cost
    partitioner do): `check_plan` then also checks ``counts`` against
    `equal_counts`.
    """

    order: Tensor
    counts: tuple[int, ...]
    equal_counts: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.order, Tensor) or self.order.dim() != 1:
            raise ValueError("Plan.order must be a 1-D tensor of global sample indices")
        if self.order.dtype.is_floating_point or self.order.dtype == torch.bool:
            raise ValueError(f"Plan.order must hold integers, got {self.order.dtype}")
        object.__setattr__(self, "order", self.order.to("cpu", torch.int64).contiguous())
        object.__setattr__(self, "counts", tuple(int(c) for c in self.counts))

    # ---- construction ------------------------------------------------------
    @classmethod
    def from_dest(cls, dest: Tensor, world_size: int, equal: bool = False) -> Plan:
        """Plan of per-sample destinations ``dest`` ([G]); every destination
        keeps its samples in ascending global index (= arrival order)."""
        dest = dest.to("cpu", torch.int64)
        if dest.numel() and (int(dest.min()) < 0 or int(dest.max()) >= world_size):
            raise ValueError(f"destinations must lie in [0, {world_size})")
        order = torch.sort(dest, stable=True).indices
        counts = torch.bincount(dest, minlength=world_size).tolist()
        return cls(order, tuple(counts), equal)

    @classmethod
    def identity(cls, batch_sizes: Sequence[int]) -> Plan:
        """Every sample stays where it is, in its local order."""
        total = sum(batch_sizes)
        return cls(torch.arange(total, dtype=torch.int64), tuple(batch_sizes), False)

    # ---- views -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.counts)

    @property
    def total(self) -> int:
        return self.order.numel()

    def offsets(self) -> Tensor:
        """``[W + 1]``: destination d's samples are ``order[off[d]:off[d + 1]]``."""
        off = torch.zeros(self.world_size + 1, dtype=torch.int64)
        torch.cumsum(torch.tensor(self.counts, dtype=torch.int64), 0, out=off[1:])
        return off

    def samples_of(self, dest: int) -> Tensor:
        """Global indices destination ``dest`` ends with, in its batch order."""
        off = self.offsets()
        return self.order[int(off[dest]) : int(off[dest + 1])]

    def dest(self) -> Tensor:
        """``[G]``: destination rank of every global sample (assumes a valid plan)."""
        out = torch.empty(self.total, dtype=torch.int64)
        counts = torch.tensor(self.counts, dtype=torch.int64)
        out[self.order] = torch.repeat_interleave(torch.arange(self.world_size), counts)
        return out

    def digest(self) -> int:
        """A 31-bit fingerprint of the plan, to check that ranks agree."""
        data = self.order.numpy().tobytes() + torch.tensor(self.counts).numpy().tobytes()
        return zlib.crc32(data) & 0x7FFFFFFF


def check_plan(plan: Plan, world_size: int, total: int) -> None:
    """Raise ValueError unless ``plan`` moves each of ``total`` samples to exactly
    one of ``world_size`` ranks (and keeps equal counts where it promises to)."""
    if not isinstance(plan, Plan):
        raise ValueError(f"a partitioner must return a Plan, got {type(plan).__name__}")
    if plan.world_size != world_size:
        raise ValueError(f"plan has {plan.world_size} destinations, world size is {world_size}")
    if min(plan.counts, default=0) < 0:
        raise ValueError(f"plan counts must be >= 0, got {plan.counts}")
    if sum(plan.counts) != total or plan.total != total:
        raise ValueError(
            f"plan places {plan.total} samples with counts summing to {sum(plan.counts)},"
            f" but the step has {total}"
        )
    if total:
        lo, hi = int(plan.order.min()), int(plan.order.max())
        if lo < 0 or hi >= total:
            raise ValueError(f"plan indices must lie in [0, {total}), got [{lo}, {hi}]")
        seen = torch.bincount(plan.order, minlength=total)
        if bool((seen != 1).any()):
            lost = torch.nonzero(seen == 0).flatten()[:5].tolist()
            dup = torch.nonzero(seen > 1).flatten()[:5].tolist()
            raise ValueError(f"plan loses samples {lost} and duplicates samples {dup}")
    if plan.equal_counts and plan.counts != equal_counts(total, world_size):
        raise ValueError(
            f"plan promises equal counts {equal_counts(total, world_size)}, got {plan.counts}"
        )


def rank_loads(plan: Plan, costs: Tensor) -> Tensor:
    """``[W]`` float64: summed per-sample ``costs`` ([G]) of each destination."""
    loads = torch.zeros(plan.world_size, dtype=torch.float64)
    return loads.index_add_(0, plan.dest(), costs.to(torch.float64))


def idle_fraction(loads: Tensor) -> float:
    """Mean idle share of a step whose ranks take ``loads``: mean(max - load) / max
    (the straggler metric of ``freescale.observe.metrics`` with T_iter = the
    slowest rank)."""
    loads = loads.to(torch.float64)
    top = float(loads.max()) if loads.numel() else 0.0
    if top <= 0.0:
        return 0.0
    return float((top - loads).mean()) / top
