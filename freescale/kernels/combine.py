"""Ranged combine: put rows received per source rank back into batch order.

After the embedding AllToAll a rank holds, for every owner rank ``r``, the rows
for the ids it sent to ``r``, in the order it sent them: the layout of its own
send buffer. Combining is therefore the inverse of the dispatch that built that
buffer: ``out[j] = recv[plan.positions[j]]``. Rows may be ids ([N]) or
embeddings / gradients ([N, D], any dtype: they are copied, never computed on).
"""

from __future__ import annotations

import torch
from torch import Tensor

from freescale.kernels.backend import choose_impl, triton_module
from freescale.kernels.dispatch import DispatchPlan
from freescale.kernels.permute import row_bytes


def ranged_combine(recv: Tensor, plan: DispatchPlan, *, impl: str | None = None) -> Tensor:
    """Rows of ``recv`` (the dispatch layout of ``plan``) back in input order."""
    if recv.dim() < 1 or recv.shape[0] != plan.num_rows:
        raise ValueError(f"recv needs {plan.num_rows} rows, got shape {tuple(recv.shape)}")
    if plan.is_identity:
        return recv
    path = choose_impl(impl, recv.device)
    if path == "torch":
        return ranged_combine_reference(recv, plan)
    if path == "eager":
        return ranged_combine_eager(recv, plan)
    return triton_module("rows").gather_rows(recv, plan.positions)


def ranged_combine_reference(recv: Tensor, plan: DispatchPlan) -> Tensor:
    """One gather of rows by the plan's positions."""
    return recv[plan.positions]


def ranged_combine_eager(recv: Tensor, plan: DispatchPlan) -> Tensor:
    """One mask and scatter per source rank (the per-rank loop baseline)."""
    out = torch.empty_like(recv)
    bounds = plan.offsets.tolist()
    for rank in range(plan.world_size):
        lo, hi = bounds[rank], bounds[rank + 1]
        idx = torch.nonzero((plan.positions >= lo) & (plan.positions < hi)).squeeze(1)
        out[idx] = recv[lo:hi]
    return out


def combine_bytes(recv: Tensor) -> int:
    """Rows read and written once, positions read once."""
    return recv.shape[0] * (2 * row_bytes(recv) + 8)


def gather_rows(table: Tensor, index: Tensor, *, impl: str | None = None) -> Tensor:
    """``table[index]``: the embedding lookup's row gather (any dtype, bit-exact).

    torch's ``index_select`` reached ~40% of copy bandwidth on 512-byte rows on
    an H200 where the Triton row mover reached ~95% (docs/LOG.md).
    """
    if table.dim() < 1 or index.dim() != 1:
        raise ValueError("gather_rows needs a table with >= 1 dim and a 1-D index")
    path = choose_impl(impl, table.device)
    if path != "triton":
        return table.index_select(0, index)
    return triton_module("rows").gather_rows(table, index)
