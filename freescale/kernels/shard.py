"""Row-wise sharding of an embedding table, and bucketize-by-shard.

Two assignments of ``num_rows`` rows to ``W`` ranks, both with
``R = ceil(num_rows / W)`` table rows allocated per rank and a closed-form
local row, so no lookup table is needed:

- ``block``: rank ``r`` owns ids ``[r*R, (r+1)*R)``; ``local = id - owner*R``.
  Hot ranges of consecutive ids all land on one rank.
- ``hashed``: ids are cut into stripes of ``W`` consecutive ids; stripe
  ``g = id // W`` is rotated by ``stripe_hash(g)``:
  ``owner = (id % W + stripe_hash(g)) % W`` and ``local = g``. Every rank owns
  one id per stripe, so the ``W`` ids of a stripe (hot consecutive ids) go to
  ``W`` different ranks, and ids with a common stride ``W`` (same ``id % W``)
  are spread too because the rotation changes from stripe to stripe.

``stripe_hash`` is a fixed integer hash into ``[0, 2**31)``, on the low 31 bits::

    x = g & 0x7FFFFFFF
    x = (x * 0x45D9F3B) & 0x7FFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & 0x7FFFFFFF
    stripe_hash = x ^ (x >> 16)

computed in int64 without overflow; the Triton kernel computes the same bits.
It is the hash of `freescale.embedding.sharding` (with ``block_size=1``), so
both give every id the same owner and local row. Ids must lie in
``[0, num_rows)``; other ids give unspecified owners.
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


@dataclass(frozen=True)
class RowSharding:
    """Which rank owns each row of a table with ``num_rows`` rows, and at which local row."""

    num_rows: int
    world_size: int
    scheme: Scheme = "block"

    def __post_init__(self) -> None:
        if self.num_rows < 0:
            raise ValueError(f"num_rows must be >= 0, got {self.num_rows}")
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.scheme not in ("block", "hashed"):
            raise ValueError(f"scheme must be 'block' or 'hashed', got {self.scheme!r}")

    @property
    def rows_per_rank(self) -> int:
        """Rows allocated on every rank (``ceil(num_rows / W)``; some may be unused)."""
        return -(-self.num_rows // self.world_size)

    def global_rows(self, rank: int) -> Tensor:
        """Global ids owned by ``rank``; entry ``i`` is the id stored at local row ``i``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        w, r = self.world_size, self.rows_per_rank
        if self.scheme == "block":
            lo = min(rank * r, self.num_rows)  # ranks past the end of the table own nothing
            return torch.arange(lo, min(lo + r, self.num_rows), dtype=torch.int64)
        stripes = torch.arange(r, dtype=torch.int64)
        ids = stripes * w + (rank - stripe_hash(stripes)) % w
        return ids[ids < self.num_rows]  # only the last stripe can be partial


def stripe_hash(g: Tensor) -> Tensor:
    """The documented stripe hash (int64 in and out, values in ``[0, 2**31)``)."""
    x = g.to(torch.int64) & _LOW31
    x = (x * HASH_MUL) & _LOW31
    x = x ^ (x >> 16)
    x = (x * HASH_MUL) & _LOW31
    return x ^ (x >> 16)


def bucketize_by_shard(
    ids: Tensor, sharding: RowSharding, *, impl: str | None = None
) -> tuple[Tensor, Tensor]:
    """Owner rank (int64) and local row (``ids.dtype``) of every id in ``ids``."""
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    path = choose_impl(impl, ids.device)
    if path == "torch":
        return bucketize_reference(ids, sharding)
    if path == "eager":
        return bucketize_eager(ids, sharding)
    return triton_module("bucketize").bucketize_triton(ids, sharding)


def bucketize_reference(ids: Tensor, sharding: RowSharding) -> tuple[Tensor, Tensor]:
    """Vectorized torch: the formulas of the module docstring."""
    x = ids.to(torch.int64)
    w, r = sharding.world_size, max(1, sharding.rows_per_rank)
    if sharding.scheme == "block":
        owner = x // r
        local = x - owner * r
    else:
        local = x // w
        owner = (x % w + stripe_hash(local)) % w
    return owner, local.to(ids.dtype)


def bucketize_eager(ids: Tensor, sharding: RowSharding) -> tuple[Tensor, Tensor]:
    """One mask per rank (the per-rank loop baseline)."""
    x = ids.to(torch.int64)
    w, r = sharding.world_size, max(1, sharding.rows_per_rank)
    owner = torch.zeros_like(x)
    local = torch.zeros_like(x)
    rotated = (x % w + stripe_hash(x // w)) % w if sharding.scheme == "hashed" else None
    for rank in range(w):
        if rotated is None:
            mask = (x >= rank * r) & (x < (rank + 1) * r)
            local[mask] = x[mask] - rank * r
        else:
            mask = rotated == rank
            local[mask] = x[mask] // w
        owner[mask] = rank
    return owner, local.to(ids.dtype)


def bucketize_bytes(num_ids: int, id_bytes: int) -> int:
    """Ids read once; owners (int64) and local rows written once."""
    return num_ids * (2 * id_bytes + 8)
