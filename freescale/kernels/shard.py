"""Row-wise sharding of an embedding table, and bucketize-by-shard.

`RowSharding` is the one row -> (owner rank, local slot) map of the library:
the sharded embedding stores rows where it says, and the dispatch kernels route
ids with the same formulas (Triton twin: `freescale.kernels.triton_bucketize`).
Every rank allocates the same number of slots (``local_rows``); the last slots
of some ranks may be padding that no valid id maps to. The map is a bijection
between ids ``[0, rows)`` and the non-padding slots, in closed form (no lookup
table), so any rank can route any id. Two assignments:

- ``block``: ``R = ceil(rows / W)`` slots per rank; rank ``r`` owns ids
  ``[r*R, (r+1)*R)``; ``local = id - owner*R``. Hot ranges of consecutive ids
  all land on one rank.
- ``hashed`` (block size ``B``): ids are cut into stripes of ``S = B*W``
  consecutive ids, each stripe into ``W`` blocks of ``B`` ids; stripe
  ``g = id // S`` rotates its blocks by ``stripe_hash(g)``:
  ``owner = ((id % S) // B + stripe_hash(g)) % W`` and
  ``local = g*B + id % B``. Every rank owns one block per stripe, so the
  ``W`` blocks of a stripe (hot consecutive ids) go to ``W`` different ranks,
  and ids with a common stride ``S`` are spread too because the rotation
  changes from stripe to stripe. With ``B = 1``: ``owner = (id % W +
  stripe_hash(id // W)) % W``, ``local = id // W``.

``stripe_hash`` is a fixed integer hash into ``[0, 2**31)``, on the low 31 bits::

    x = g & 0x7FFFFFFF
    x = (x * 0x45D9F3B) & 0x7FFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & 0x7FFFFFFF
    stripe_hash = x ^ (x >> 16)

computed in int64 without overflow; the Triton kernel computes the same bits.
`RowSharding.locate` gives ids outside ``[0, rows)`` an owner in ``[0, W)``
too (the embedding masks them later); the bucketize ops and kernels take ids
in ``[0, rows)`` only and give other ids unspecified owners.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from freescale.kernels.backend import choose_impl, triton_module

Scheme = Literal["block", "hashed"]
HASH_MUL = 0x45D9F3B
_LOW31 = 0x7FFFFFFF


def stripe_hash(g: Tensor) -> Tensor:
    """The documented stripe hash (int64 in and out, values in ``[0, 2**31)``)."""
    x = g.to(torch.int64) & _LOW31
    x = (x * HASH_MUL) & _LOW31
    x = x ^ (x >> 16)
    x = (x * HASH_MUL) & _LOW31
    return x ^ (x >> 16)


@dataclass(frozen=True)
class RowSharding:
    """Assignment of ``rows`` ids over ``world_size`` ranks (see the module docstring)."""

    rows: int
    world_size: int
    kind: Scheme = "hashed"
    block_size: int = 1

    def __post_init__(self) -> None:
        if self.rows < 1:
            raise ValueError(f"rows must be >= 1, got {self.rows}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kind not in ("hashed", "block"):
            raise ValueError(f"assignment kind must be 'block' or 'hashed', got {self.kind!r}")
        if self.kind == "hashed" and self.rows // self.span >= 2**31:
            raise ValueError("too many stripes for the 31-bit stripe hash; raise block_size")

    @property
    def span(self) -> int:
        """Ids per stripe of the hashed assignment (``block_size * world_size``)."""
        return self.block_size * self.world_size

    @property
    def local_rows(self) -> int:
        """Slots per rank (equal on every rank; the last ones may be padding)."""
        if self.kind == "block":
            return -(-self.rows // self.world_size)
        return -(-self.rows // self.span) * self.block_size

    def locate(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Owner rank (in ``[0, W)`` even for invalid ids) and local slot, both int64."""
        ids = ids.to(torch.int64)
        if self.world_size == 1:  # what the formulas give: every id is its own slot
            return torch.zeros_like(ids), ids
        return self.locate_by_formula(ids)

    def locate_by_formula(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """`locate` through the module docstring's formulas at any world size."""
        ids = ids.to(torch.int64)
        if self.kind == "block":
            per = self.local_rows
            owner = torch.div(ids, per, rounding_mode="floor").clamp_(0, self.world_size - 1)
            return owner, ids - owner * per
        stripe = torch.div(ids, self.span, rounding_mode="floor")
        within = ids - stripe * self.span
        block = torch.div(within, self.block_size, rounding_mode="floor")
        owner = (block + stripe_hash(stripe)) % self.world_size
        return owner, stripe * self.block_size + (within - block * self.block_size)

    def global_ids(self, rank: int, device: torch.device | str = "cpu") -> Tensor:
        """Global id held in each local slot of ``rank``; -1 for padding slots
        (always a suffix: ``ids[ids >= 0]`` are the rank's ids in slot order)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        slot = torch.arange(self.local_rows, dtype=torch.int64, device=device)
        if self.kind == "block":
            ids = rank * self.local_rows + slot
        else:
            stripe = torch.div(slot, self.block_size, rounding_mode="floor")
            block = (rank - stripe_hash(stripe)) % self.world_size
            ids = stripe * self.span + block * self.block_size + (slot - stripe * self.block_size)
        return torch.where(ids < self.rows, ids, torch.full_like(ids, -1))


def bucketize_by_shard(
    ids: Tensor, sharding: RowSharding, *, impl: str | None = None
) -> tuple[Tensor, Tensor]:
    """Owner rank (int64) and local row (``ids.dtype``) of every id in ``[0, rows)``."""
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    path = choose_impl(impl, ids.device)
    if path == "torch":
        return bucketize_reference(ids, sharding)
    if path == "eager":
        return bucketize_eager(ids, sharding)
    return triton_module("bucketize").bucketize_triton(ids, sharding)


def bucketize_reference(ids: Tensor, sharding: RowSharding) -> tuple[Tensor, Tensor]:
    """Vectorized torch: `RowSharding.locate`, local rows in the ids' dtype."""
    owner, local = sharding.locate(ids)
    return owner, local.to(ids.dtype)


def bucketize_eager(ids: Tensor, sharding: RowSharding) -> tuple[Tensor, Tensor]:
    """One mask per rank (the per-rank loop baseline)."""
    owner_of, local_of = sharding.locate(ids)
    owner = torch.zeros_like(owner_of)
    local = torch.zeros_like(local_of)
    for rank in range(sharding.world_size):
        mask = owner_of == rank
        local[mask] = local_of[mask]
        owner[mask] = rank
    return owner, local.to(ids.dtype)


def bucketize_bytes(num_ids: int, id_bytes: int) -> int:
    """Ids read once; owners (int64) and local rows written once."""
    return num_ids * (2 * id_bytes + 8)
