"""Ranged dispatch: pack rows into one contiguous send buffer, grouped by destination.

Before the ids AllToAll of the sharded embedding, every id goes to the rank
that owns its row; before the gradient AllToAll, every gradient row follows
its id. The send buffer holds the rows for rank 0, then rank 1, ...; inside a
destination rows keep their input order (stable), so the receiver sees each
source's rows in batch order and the result is deterministic.

The `DispatchPlan` records where every row went; `apply_dispatch` reuses it
for more rows (gradients) and `freescale.kernels.combine.ranged_combine`
undoes it. The plan is built without reading device memory back on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from freescale.jagged import ops
from freescale.kernels.backend import choose_impl, triton_module
from freescale.kernels.permute import row_bytes
from freescale.kernels.shard import RowSharding, bucketize_eager, bucketize_reference


@dataclass(frozen=True)
class DispatchPlan:
    """``send[positions[j]]`` is input row ``j``; rows for rank ``r`` are
    ``send[offsets[r]:offsets[r + 1]]`` (``counts[r]`` of them), in input order."""

    counts: Tensor  # [W] int64
    offsets: Tensor  # [W + 1] int64
    positions: Tensor  # [N] int64
    # positions == arange(N) (one destination): placing rows by it, or taking
    # them back, returns the rows themselves instead of a copy
    is_identity: bool = False

    @property
    def world_size(self) -> int:
        return self.counts.numel()

    @property
    def num_rows(self) -> int:
        return self.positions.numel()

    @staticmethod
    def from_counts(counts: Tensor, positions: Tensor) -> DispatchPlan:
        counts = counts.to(torch.int64)
        return DispatchPlan(counts, ops.lengths_to_offsets(counts), positions)

    @staticmethod
    def identity(num_rows: int, device: torch.device) -> DispatchPlan:
        """Every row to rank 0, in place: what a stable sort gives one destination."""
        return _IdentityPlan(num_rows, device)


class _IdentityPlan(DispatchPlan):
    """`DispatchPlan.identity`: its tensors are built on first use. One rank's
    lookups place and take back rows without them, so no kernel builds them."""

    def __init__(self, num_rows: int, device: torch.device) -> None:
        object.__setattr__(self, "_rows", num_rows)
        object.__setattr__(self, "_device", device)
        object.__setattr__(self, "is_identity", True)

    @property
    def world_size(self) -> int:
        return 1

    @property
    def num_rows(self) -> int:
        return self._rows

    @cached_property
    def counts(self) -> Tensor:  # type: ignore[override]
        return torch.full((1,), self._rows, dtype=torch.int64, device=self._device)

    @cached_property
    def offsets(self) -> Tensor:  # type: ignore[override]
        return ops.lengths_to_offsets(self.counts)

    @cached_property
    def positions(self) -> Tensor:  # type: ignore[override]
        return torch.arange(self._rows, device=self._device)


def ranged_dispatch(
    values: Tensor, dest: Tensor, world_size: int, *, impl: str | None = None
) -> tuple[Tensor, DispatchPlan]:
    """Rows of ``values`` ([N] or [N, ...]) grouped by ``dest`` ([N], in ``[0, world_size)``).

    One destination (world size 1) needs no sort: the send buffer is
    ``values`` itself (not a copy) and the plan the identity."""
    _check(values, dest, world_size)
    if world_size == 1:
        return values, DispatchPlan.identity(values.shape[0], values.device)
    path = choose_impl(impl, values.device)
    if path == "torch":
        return ranged_dispatch_reference(values, dest, world_size)
    if path == "eager":
        return ranged_dispatch_eager(values, dest, world_size)
    return triton_module("dispatch").ranged_dispatch_triton(values, dest, world_size)


def ranged_dispatch_ids(
    ids: Tensor, sharding: RowSharding, *, local: bool = True, impl: str | None = None
) -> tuple[Tensor, DispatchPlan]:
    """Ids grouped by owner rank (`RowSharding`); the send buffer holds local
    rows if ``local`` else the global ids. The Triton path computes owners
    inside the kernel instead of materializing them."""
    if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be a 1-D integer tensor, got {ids.dtype} {tuple(ids.shape)}")
    path = choose_impl(impl, ids.device)
    if path == "triton":
        return triton_module("dispatch").ranged_dispatch_ids_triton(ids, sharding, local)
    bucketize = bucketize_reference if path == "torch" else bucketize_eager
    owner, local_rows = bucketize(ids, sharding)
    send = local_rows if local else ids
    if path == "torch":
        return ranged_dispatch_reference(send, owner, sharding.world_size)
    return ranged_dispatch_eager(send, owner, sharding.world_size)


def apply_dispatch(values: Tensor, plan: DispatchPlan, *, impl: str | None = None) -> Tensor:
    """Rows of ``values`` placed as ``plan`` placed the rows it was built from."""
    if values.dim() < 1 or values.shape[0] != plan.num_rows:
        raise ValueError(f"values need {plan.num_rows} rows, got shape {tuple(values.shape)}")
    if plan.is_identity:
        return values
    path = choose_impl(impl, values.device)
    if path == "torch":
        return apply_dispatch_reference(values, plan)
    if path == "eager":
        return apply_dispatch_eager(values, plan)
    return triton_module("rows").scatter_rows(values, plan.positions)


# ---- reference and eager ----------------------------------------------------
def ranged_dispatch_reference(
    values: Tensor, dest: Tensor, world_size: int
) -> tuple[Tensor, DispatchPlan]:
    """Vectorized torch: stable sort by destination, then one gather."""
    dest = dest.to(torch.int64)
    order = torch.sort(dest, stable=True).indices
    counts = torch.zeros(world_size, dtype=torch.int64, device=dest.device)
    counts.scatter_add_(0, dest, torch.ones_like(dest))
    positions = torch.empty_like(order)
    positions.scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return values[order], DispatchPlan.from_counts(counts, positions)


def ranged_dispatch_eager(
    values: Tensor, dest: Tensor, world_size: int
) -> tuple[Tensor, DispatchPlan]:
    """One boolean mask and gather per destination rank, then concatenate."""
    parts, picked = [], []
    for rank in range(world_size):
        idx = torch.nonzero(dest == rank).squeeze(1)
        parts.append(values[idx])
        picked.append(idx)
    order = torch.cat(picked)
    positions = torch.empty_like(order)
    positions[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.tensor([p.numel() for p in picked], dtype=torch.int64, device=dest.device)
    return torch.cat(parts), DispatchPlan.from_counts(counts, positions)


def apply_dispatch_reference(values: Tensor, plan: DispatchPlan) -> Tensor:
    """One scatter of rows by the plan's positions."""
    send = torch.empty_like(values)
    send[plan.positions] = values
    return send


def apply_dispatch_eager(values: Tensor, plan: DispatchPlan) -> Tensor:
    """One mask and copy per destination rank."""
    send = torch.empty_like(values)
    bounds = plan.offsets.tolist()
    for rank in range(plan.world_size):
        lo, hi = bounds[rank], bounds[rank + 1]
        idx = torch.nonzero((plan.positions >= lo) & (plan.positions < hi)).squeeze(1)
        send[lo:hi] = values[idx]
    return send


def dispatch_bytes(values: Tensor, dest_bytes: int) -> int:
    """Rows read and written once, destinations read once, positions written once."""
    return values.shape[0] * (2 * row_bytes(values) + dest_bytes + 8)


def _check(values: Tensor, dest: Tensor, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if values.dim() < 1 or dest.shape != (values.shape[0],):
        raise ValueError(
            f"dest must be 1-D with one entry per row: values {tuple(values.shape)},"
            f" dest {tuple(dest.shape)}"
        )
    if dest.dtype.is_floating_point or dest.dtype == torch.bool:
        raise ValueError(f"dest must be an integer tensor, got {dest.dtype}")
