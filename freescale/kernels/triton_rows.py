"""Triton row gather / scatter: ranged combine and `apply_dispatch`.

References: `freescale.kernels.combine.ranged_combine_reference` (gather,
``out[i] = src[index[i]]``) and `freescale.kernels.dispatch.apply_dispatch_reference`
(scatter, ``out[index[i]] = src[i]``).

Element-parallel over rows: a program moves a ``[BLOCK_R, BLOCK_W]`` tile of
integer words, so a 512-byte embedding row is one coalesced burst and the
reads (scatter) or writes (gather) stream contiguously. Any dtype moves
bit-exactly because rows are copied as words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freescale.kernels.combine import combine_bytes, ranged_combine_reference
from freescale.kernels.dispatch import DispatchPlan, apply_dispatch_reference
from freescale.kernels.triton_common import (
    as_words,
    bench_ms,
    cdiv,
    check_launchable,
    copy_rows,
    gbps,
    tile,
)


# ---- kernel ---------------------------------------------------------------
@triton.jit(do_not_specialize=["n"])
def _move_rows_kernel(
    src, dst, index, n, W, GATHER: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = rows < n
    other = tl.load(index + rows, mask=mask, other=0)
    if GATHER:
        copy_rows(src, dst, other, rows, mask, W, BLOCK_W)
    else:
        copy_rows(src, dst, rows, other, mask, W, BLOCK_W)


# ---- launchers ------------------------------------------------------------
def gather_rows(src: Tensor, index: Tensor, *, block_rows: int | None = None) -> Tensor:
    """``out[i] = src[index[i]]`` for every row ``i`` of ``index``."""
    out = src.new_empty((index.shape[0], *src.shape[1:]))
    _launch(src.contiguous(), out, index, True, block_rows)
    return out


def scatter_rows(src: Tensor, index: Tensor, *, block_rows: int | None = None) -> Tensor:
    """``out[index[i]] = src[i]``; ``index`` must be a permutation of the rows."""
    out = torch.empty_like(src, memory_format=torch.contiguous_format)
    _launch(src.contiguous(), out, index, False, block_rows)
    return out


def _launch(src: Tensor, dst: Tensor, index: Tensor, gather: bool, block_rows: int | None) -> None:
    n = index.shape[0]
    s, d = as_words(src, dst)
    W = s.shape[1]
    if n == 0 or W == 0:
        return
    check_launchable(_move_rows_kernel, src.device)
    BLOCK_R, BLOCK_W = tile(W)
    BLOCK_R = block_rows or BLOCK_R
    _move_rows_kernel[(cdiv(n, BLOCK_R),)](
        s, d, index.to(torch.int64), n, W, GATHER=gather, BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W
    )


# ---- check and GB/s -------------------------------------------------------
def random_plan(n: int, world_size: int, device: str, seed: int = 0) -> DispatchPlan:
    """The plan of a stable dispatch of ``n`` rows to random destinations."""
    g = torch.Generator().manual_seed(seed)
    dest = torch.randint(0, world_size, (n,), generator=g)
    order = torch.sort(dest, stable=True).indices
    positions = torch.empty_like(order)
    positions[order] = torch.arange(n)
    counts = torch.bincount(dest, minlength=world_size)
    return DispatchPlan.from_counts(counts.to(device), positions.to(device))


def check(device: str = "cuda", n: int = 10_000, dim: int = 128, world_size: int = 64) -> None:
    """Gather and scatter against the references (raises on mismatch)."""
    plan = random_plan(n, world_size, device)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        rows = torch.randn(n, dim).to(device=device, dtype=dtype)
        assert torch.equal(gather_rows(rows, plan.positions), ranged_combine_reference(rows, plan))
        assert torch.equal(scatter_rows(rows, plan.positions), apply_dispatch_reference(rows, plan))


def bench(n: int = 512_000, dim: int = 128, world_size: int = 64) -> dict[str, float]:
    """Milliseconds and GB/s of the combine gather on CUDA."""
    plan = random_plan(n, world_size, "cuda")
    recv = torch.randn(n, dim, device="cuda")
    ms = bench_ms(lambda: gather_rows(recv, plan.positions))
    ref_ms = bench_ms(lambda: ranged_combine_reference(recv, plan))
    return {"ms": ms, "torch_ms": ref_ms, "gbps": gbps(combine_bytes(recv), ms)}


if __name__ == "__main__":
    check()
    print(bench())
