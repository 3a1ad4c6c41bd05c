"""Row -> (owner rank, local slot) assignment of one row-wise sharded table.

Every rank stores the same number of slots (``local_rows``); the last slots
of some ranks may be padding that no valid id maps to. The map is a
bijection between valid ids and non-padding slots, computed with a few
integer ops (no lookup tables), so any rank can route any id.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_MASK31 = 0x7FFFFFFF
_MULT = 0x45D9F3B  # a well-mixing 32-bit multiplier; products stay below 2**63


def stripe_hash(stripe: Tensor) -> Tensor:
    """Deterministic integer hash of int64 values, into [0, 2**31)."""
    x = stripe & _MASK31
    x = (x * _MULT) & _MASK31
    x = x ^ (x >> 16)
    x = (x * _MULT) & _MASK31
    return x ^ (x >> 16)


@dataclass(frozen=True)
class RowSharding:
    """Assignment of ``rows`` ids over ``world_size`` ranks (see `ShardingPlan`)."""

    rows: int
    world_size: int
    kind: str = "hashed"
    block_size: int = 1

    def __post_init__(self) -> None:
        if self.rows < 1 or self.world_size < 1 or self.block_size < 1:
            raise ValueError("rows, world_size and block_size must be >= 1")
        if self.kind not in ("hashed", "block"):
            raise ValueError(f"unknown assignment {self.kind!r}")
        if self.rows // (self.block_size * self.world_size) >= 2**31:
            raise ValueError("too many stripes for the 31-bit stripe hash; raise block_size")

    @property
    def _span(self) -> int:
        return self.block_size * self.world_size

    @property
    def local_rows(self) -> int:
        """Slots per rank (equal on every rank)."""
        if self.kind == "block":
            return -(-self.rows // self.world_size)
        return -(-self.rows // self._span) * self.block_size

    def locate(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Owner rank (in [0, W) even for invalid ids) and local slot of each id."""
        ids = ids.to(torch.int64)
        if self.kind == "block":
            per = self.local_rows
            owner = torch.div(ids, per, rounding_mode="floor").clamp_(0, self.world_size - 1)
            return owner, ids - owner * per
        stripe = torch.div(ids, self._span, rounding_mode="floor")
        within = ids - stripe * self._span
        block = torch.div(within, self.block_size, rounding_mode="floor")
        owner = (block + stripe_hash(stripe)) % self.world_size
        return owner, stripe * self.block_size + (within - block * self.block_size)

    def global_ids(self, rank: int, device: torch.device | str = "cpu") -> Tensor:
        """Global id held in each local slot of ``rank``; -1 for padding slots."""
        slot = torch.arange(self.local_rows, dtype=torch.int64, device=device)
        if self.kind == "block":
            ids = rank * self.local_rows + slot
        else:
            stripe = torch.div(slot, self.block_size, rounding_mode="floor")
            block = (rank - stripe_hash(stripe)) % self.world_size
            ids = stripe * self._span + block * self.block_size + (slot - stripe * self.block_size)
        return torch.where(ids < self.rows, ids, torch.full_like(ids, -1))
