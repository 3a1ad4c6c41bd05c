"""Fixed Batch Size (FBS) partitioning and the identity plan (paper §4.1).

FBS sorts all samples of the step by length (longest first, ties by global
index) and deals them out zig-zag: with n ranks, rank i gets sorted positions
i, 2n-1-i, 2n+i, 4n-1-i, ... Each full round of 2n samples gives every rank one
long and one short sample, so per-rank token sums stay close while every rank
gets the same number of samples.

When G is not a multiple of n, the last, partial round (the r = G mod n
shortest samples) goes to ranks 0..r-1, in the direction the zig-zag would
take in that round. So the first ``G mod n`` ranks hold one sample more:
exactly `freescale.balance.plan.equal_counts`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from freescale.balance.plan import Plan
from freescale.balance.runtime import RuntimeInfo
from freescale.balance.world import WorldLengths

KEYS = ("uih", "tokens")


def descending_order(keys: Tensor) -> Tensor:
    """Indices sorting ``keys`` longest first; equal keys keep ascending index."""
    return torch.sort(keys, descending=True, stable=True).indices


def zigzag_ranks(num: int, world_size: int) -> Tensor:
    """``[num]``: the rank of each sorted position under the FBS zig-zag."""
    pos = torch.arange(num, dtype=torch.int64)
    rnd, j = pos // world_size, pos % world_size
    ranks = torch.where(rnd % 2 == 0, j, world_size - 1 - j)
    full = (num // world_size) * world_size
    rest = num - full
    if rest:
        # Partial last round: ranks 0..rest-1 only (they get the extra sample).
        j_tail = pos[full:] - full
        even = (num // world_size) % 2 == 0
        ranks[full:] = j_tail if even else rest - 1 - j_tail
    return ranks


def sample_keys(world: WorldLengths, key: str) -> Tensor:
    """Length used for sorting: UIH length, or all tokens (UIH + candidates + content)."""
    if key == "uih":
        return world.uih_lengths
    return world.uih_lengths + world.num_candidates + world.content_per_sample()


def zigzag_plan(keys: Tensor, world_size: int) -> Plan:
    """FBS plan for per-sample sort ``keys`` ([G], int or float)."""
    sorted_idx = descending_order(keys)
    dest = torch.empty(keys.numel(), dtype=torch.int64)
    dest[sorted_idx] = zigzag_ranks(keys.numel(), world_size)
    return Plan.from_dest(dest, world_size, equal=True)


@dataclass(frozen=True)
class FBS:
    """Fixed-batch-size partitioner. ``key="uih"`` sorts by UIH length (the
    paper); ``"tokens"`` by UIH + candidates + content lengths."""

    key: str = "uih"

    def __post_init__(self) -> None:
        if self.key not in KEYS:
            raise ValueError(f"FBS key must be one of {KEYS}, got {self.key!r}")

    def __call__(self, world: WorldLengths, runtime: RuntimeInfo) -> Plan:
        return zigzag_plan(sample_keys(world, self.key), world.world_size)


def identity(world: WorldLengths, runtime: RuntimeInfo) -> Plan:
    """The "none" partitioner: every sample stays on its rank, in local order."""
    return Plan.identity(world.batch_sizes)
