"""The weight gradient of a lookup into a small table (a few rows: action types),
and column sums (a bias gradient: a table of one row that every position reads).

``grad_weight[r] = sum of grad[j] over the positions j with ids[j] == r``.

torch's CUDA embedding backward sorts the ids first: ~30 kernels (an 8-pass
64-bit radix sort and its segment bookkeeping) for a table of a handful of
rows, and, outside deterministic mode, sums the partial segments with float
atomics (run-to-run different bits). The Triton path is two kernels and no
atomics: each program sums a fixed stretch of positions for every row, then
one program per row and column block adds those partials in program order.
Same order on every run, so bitwise reproducible; it differs from the sort's
order, so it agrees with the reference to rounding, not bitwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from freescale.kernels.backend import choose_impl, triton_module

MAX_ROWS = 32  # larger tables: torch's sort-based backward (the Triton tile grows with rows)


def small_table_grad(grad: Tensor, ids: Tensor, rows: int, *, impl: str | None = None) -> Tensor:
    """``[rows, D]`` weight gradient of ``table[ids]`` given its output gradient ``[N, D]``.

    ``ids`` must lie in ``[0, rows)`` (a lookup with other ids fails in forward;
    the Triton path would leave them out).
    The result has ``grad``'s dtype, summed in fp32."""
    if grad.dim() != 2 or ids.dim() != 1 or grad.shape[0] != ids.shape[0]:
        raise ValueError(
            f"need grad [N, D] and ids [N], got {tuple(grad.shape)} and {tuple(ids.shape)}"
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"ids must be integers, got {ids.dtype}")
    if ids.device != grad.device:
        raise ValueError(f"ids on {ids.device} but grad on {grad.device}")
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"rows must be in [1, {MAX_ROWS}], got {rows}")
    if choose_impl(impl, grad.device) == "triton":
        return triton_module("small_table").small_table_grad_triton(grad, ids, rows)
    return small_table_grad_reference(grad, ids, rows)


def small_table_grad_reference(grad: Tensor, ids: Tensor, rows: int) -> Tensor:
    """One ``index_add`` in fp32 (deterministic on the CPU)."""
    out = torch.zeros(rows, grad.shape[1], dtype=torch.float32, device=grad.device)
    return out.index_add_(0, ids.to(torch.int64), grad.to(torch.float32)).to(grad.dtype)


def column_sums(x: Tensor, *, impl: str | None = None) -> Tensor:
    """``x.sum(0)`` of a 2-D ``x``, summed in fp32, in ``x``'s dtype.

    The Triton path is the two kernels above, without a memset: torch's
    column reduction zeroes its semaphores with one, and inside a CUDA graph
    a memset node costs the GPU ~3 µs of idle before the next kernel."""
    if x.dim() != 2:
        raise ValueError(f"need a 2-D tensor, got shape {tuple(x.shape)}")
    if choose_impl(impl, x.device) == "triton":
        return triton_module("small_table").small_table_grad_triton(x, None, 1)[0]
    return x.to(torch.float32).sum(0).to(x.dtype)
