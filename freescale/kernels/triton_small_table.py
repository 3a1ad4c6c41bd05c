"""Triton kernels of `freescale.kernels.small_table`: partial sums, then their totals."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freescale.kernels.triton_common import cdiv, check_launchable, next_pow2

PARTIALS = 512  # programs along the positions: enough to fill the GPU, few to add up
TILE = 8192  # elements of a program's select tile [ROWS, BLOCK_T, BLOCK_D]


@triton.jit(do_not_specialize=["n", "per_program"])
def _partials_kernel(
    ids, grad, partial, n, D, per_program, ROWS: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr, HAS_IDS: tl.constexpr,
):  # fmt: skip
    """``partial[p, r, cols]``: the sum of the gradient rows of id ``r`` among
    positions ``[p * per_program, (p + 1) * per_program)``, in position order
    by tiles of ``BLOCK_T``. Without ids (``HAS_IDS`` false) every position is row 0."""
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    table_rows = tl.arange(0, ROWS)
    acc = tl.full((ROWS, BLOCK_D), 0.0, tl.float32)
    start = p.to(tl.int64) * per_program
    for t0 in range(0, per_program, BLOCK_T):
        pos = start + t0 + tl.arange(0, BLOCK_T)
        ok = pos < n
        g = tl.load(
            grad + pos[:, None] * D + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0
        ).to(tl.float32)
        if HAS_IDS:
            idx = tl.load(ids + pos, mask=ok, other=-1)
            # A select, not a one-hot product: a non-finite gradient reaches its own row only.
            picked = tl.where(table_rows[:, None, None] == idx[None, :, None], g[None, :, :], 0.0)
            acc += tl.reduce(picked, 1, tl.standard._sum_combine)
        else:  # every position is row 0: column sums
            acc += tl.reduce(g, 0, tl.standard._sum_combine)[None, :]
    out = partial + (p.to(tl.int64) * ROWS + table_rows[:, None]) * D + cols[None, :]
    tl.store(out, acc, mask=col_ok[None, :])


@triton.jit(do_not_specialize=["programs"])
def _totals_kernel(
    partial, out, programs, D, ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr
):
    """``out[r, cols]``: row ``r``'s partials added in program order, by tiles of
    ``BLOCK_P`` (one tile at most `PARTIALS` programs: a loop of loads in a chain
    would pay the memory latency once per tile)."""
    r = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.full((BLOCK_D,), 0.0, tl.float32)
    for p0 in range(0, programs, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        m = (p < programs)[:, None] & col_ok[None, :]
        x = tl.load(partial + (p[:, None].to(tl.int64) * ROWS + r) * D + cols[None, :], mask=m)
        acc += tl.reduce(tl.where(m, x, 0.0), 0, tl.standard._sum_combine)
    tl.store(out + r * D + cols, acc.to(out.dtype.element_ty), mask=col_ok)


def small_table_grad_triton(grad: Tensor, ids: Tensor | None, rows: int) -> Tensor:
    """`small_table_grad`; ``ids=None``: every position is row 0 (``rows == 1``)."""
    n, D = grad.shape
    out = torch.empty(rows, D, dtype=grad.dtype, device=grad.device)
    if n == 0 or D == 0:
        return out.zero_()
    check_launchable(_partials_kernel, grad.device)
    ROWS = next_pow2(rows)
    BLOCK_D = min(128, next_pow2(D))  # 256 contiguous bytes of a bf16 row per load
    BLOCK_T = max(1, TILE // (ROWS * BLOCK_D))
    per_program = BLOCK_T * cdiv(n, BLOCK_T * PARTIALS)
    programs = cdiv(n, per_program)
    partial = torch.empty(programs, ROWS, D, dtype=torch.float32, device=grad.device)
    _partials_kernel[(programs, cdiv(D, BLOCK_D))](
        grad if ids is None else ids.contiguous(), grad.contiguous(), partial, n, D, per_program,
        ROWS=ROWS, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, HAS_IDS=ids is not None,
    )  # fmt: skip
    _totals_kernel[(rows, cdiv(D, 32))](
        partial, out, programs, D, ROWS=ROWS, BLOCK_P=PARTIALS, BLOCK_D=32, num_warps=8
    )
    return out
