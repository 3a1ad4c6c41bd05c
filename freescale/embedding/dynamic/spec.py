"""Dynamic tables: any int64 id gets a row on the fly, in bounded memory.

A table with ``capacity`` > 0 (`DynamicSpec`) holds about ``capacity``
rows over all ranks (`DynamicSpec.local_capacity` per rank). Everything is a
function of the ids and the order of the steps alone, never of timing, the
mode or the world size where the contract says so:

- the owner of an id is a fixed 64-bit mix of it (`owner_of`), modulo W;
- a new row starts from values drawn from (table seed, id) (`initial_rows`);
- each shard maps its ids to its slots (`freescale.embedding.dynamic.map`), once per
  lookup call in call order, on the ids the shard receives. An id without a
  row is admitted on its ``admit_after``-th call (before that it reads zeros
  and its gradient is dropped) and takes a free slot, else the slot of the
  least recently (``lru``) or least frequently (``lfu``) used id, ties broken
  by the smaller id, never one read by this call or the one before it.

A prefetching mode maps call i+1 during call i, after call i-1's last
update and before call i's: the ids it may evict were read by neither, so
no pending update and no prefetched row can meet a reused slot, and every
mode maps the same ids in the same order to the same slots.

This module holds the rules (spec, owner, initial values);
`freescale.embedding.dynamic.map` the per-shard map,
`freescale.embedding.dynamic.shard` a store's side of it.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

EVICTIONS = ("lru", "lfu")
# splitmix64's finalizer constants, as signed int64 (torch has no uint64 arithmetic).
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_LOW63 = (1 << 63) - 1


@dataclass(frozen=True)
class DynamicSpec:
    """``capacity`` rows over all ranks; ``evict``: ``lru`` or ``lfu``;
    ``admit_after``: calls an id is seen in before it gets a row."""

    capacity: int
    evict: str = "lru"
    admit_after: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, int):
            raise ValueError(f"capacity must be an integer >= 1, got {self.capacity!r}")
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1 (0: a static table), got {self.capacity}")
        if self.evict not in EVICTIONS:
            raise ValueError(f"evict must be one of {', '.join(EVICTIONS)}, got {self.evict!r}")
        if (
            isinstance(self.admit_after, bool)
            or not isinstance(self.admit_after, int)
            or self.admit_after < 1
        ):
            raise ValueError(f"admit_after must be an integer >= 1, got {self.admit_after!r}")

    def local_capacity(self, world_size: int) -> int:
        """Rows per rank: the even share plus 4 standard deviations of the
        hash's spread (`owner_of` deals ids like dice), so ``capacity`` rows
        hold any ``capacity`` distinct ids but with odds below 1e-4 per rank:
        +1.1 % at 1M rows over 8 ranks, more on small tables."""
        share = self.capacity / world_size
        if world_size == 1:
            return self.capacity
        return math.ceil(share + 4.0 * math.sqrt(share))

    @property
    def bound(self) -> float:
        """New rows start uniform in ``[-bound, bound)``: ``sqrt(1 / capacity)``."""
        return math.sqrt(1.0 / self.capacity)


def _shr(x: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(x: Tensor) -> Tensor:
    """splitmix64's finalizer on int64 bits (wrapping multiplies), int64 out."""
    x = x.to(torch.int64)
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def owner_of(ids: Tensor, world_size: int) -> Tensor:
    """The rank owning each id: fixed by the id and W alone."""
    if world_size == 1:
        return torch.zeros_like(ids, dtype=torch.int64)
    return (mix64(ids) & _LOW63) % world_size


def table_seed(seed: int, name: str) -> int:
    """A table's seed: the collection's seed and the table's name, not its group."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & _LOW63


def initial_rows(seed: int, ids: Tensor, dim: int, dtype: torch.dtype, bound: float) -> Tensor:
    """``[len(ids), dim]`` values uniform in ``[-bound, bound)``, drawn from
    (seed, id, column) by hashing: the same on every device, rank and step."""
    cols = torch.arange(dim, dtype=torch.int64, device=ids.device)
    key = mix64(ids.to(torch.int64) ^ mix64(torch.tensor(seed, device=ids.device)))
    bits = mix64(key.unsqueeze(1) + cols * _GOLDEN)
    u = _shr(bits, 40).to(torch.float64) / float(1 << 24)  # 24 bits: exact in float32
    return ((u * 2.0 - 1.0) * bound).to(dtype)
