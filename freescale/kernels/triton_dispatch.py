"""Triton ranged dispatch: a stable counting sort of rows by destination rank.

Reference: `freescale.kernels.dispatch.ranged_dispatch_reference` (stable sort
by destination, then gather). A row's place in the send buffer is

    position(j) = offsets[d] + #{rows before j in earlier blocks with dest d}
                             + #{rows before j in its own block with dest d},   d = dest[j]

Element-parallel over blocks of ``BLOCK`` rows, in two passes and a scan:

1. ``count``: each block counts its rows per destination by comparing its rows
   with each other (``[BLOCK, SUB]`` tiles) into ``hist[d, block]``;
2. torch: an exclusive cumsum of ``hist`` in (destination, block) order gives
   ``base[d, block]``, the first slot of that block's rows for ``d``;
3. ``place``: each block recomputes the in-block rank (rows before it with the
   same destination), writes ``positions`` and copies 1-D rows (ids) directly.
   Wider rows (embeddings) are then moved by the row kernel of `triton_rows`.

Compares cost ``O(N * BLOCK)`` and the histogram ``O(N * W / BLOCK)``, so
``BLOCK`` grows like ``sqrt(W)``. Owners of ids can be computed in the kernels
(`triton_bucketize.owner_and_local`), so the id path never materializes them.
Nothing is read back on the host.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from freescale.kernels.dispatch import DispatchPlan, dispatch_bytes, ranged_dispatch_reference
from freescale.kernels.shard import RowSharding
from freescale.kernels.triton_bucketize import owner_and_local
from freescale.kernels.triton_common import (
    as_words,
    bench_ms,
    cdiv,
    check_launchable,
    count_true,
    gbps,
)
from freescale.kernels.triton_rows import scatter_rows

DEST_GIVEN, DEST_BLOCK, DEST_HASHED = 0, 1, 2
TILE = 2048  # compare-tile elements (BLOCK * SUB): 16 per thread at 4 warps


# ---- kernels --------------------------------------------------------------
@triton.jit
def _load_dest(src, i, mask, W, rows_per_rank, MODE: tl.constexpr):
    """Destination of rows ``i`` (-1 where masked or outside ``[0, W)``)."""
    x = tl.load(src + i, mask=mask, other=0).to(tl.int64)
    if MODE == 0:
        d = x
    else:
        d, _ = owner_and_local(x, W, rows_per_rank, MODE == 2)
    ok = mask & (d >= 0) & (d < W)
    return tl.where(ok, d, -1).to(tl.int32), ok


@triton.jit
def _count_kernel(
    src,
    hist,
    n,
    W,
    rows_per_rank,
    n_blocks,
    MODE: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
):
    """``hist[d * n_blocks + block]`` = rows of this block with destination ``d``."""
    block = tl.program_id(0).to(tl.int64)
    i = block * BLOCK + tl.arange(0, BLOCK)
    di, ok = _load_dest(src, i, i < n, W, rows_per_rank, MODE)
    total = tl.full([BLOCK], 0, tl.int32)
    before = tl.full([BLOCK], 0, tl.int32)
    for j0 in range(0, BLOCK, SUB):
        j = block * BLOCK + j0 + tl.arange(0, SUB)
        dj, okj = _load_dest(src, j, j < n, W, rows_per_rank, MODE)
        same = (di[:, None] == dj[None, :]) & okj[None, :]
        total += count_true(same)
        before += count_true(same & (j[None, :] < i[:, None]))
    # the first row of each destination writes that destination's count
    tl.store(hist + di.to(tl.int64) * n_blocks + block, total, mask=ok & (before == 0))


@triton.jit
def _place_kernel(
    src,
    values,
    base,
    positions,
    send,
    n,
    W,
    rows_per_rank,
    n_blocks,
    MODE: tl.constexpr,
    COPY: tl.constexpr,
    LOCAL: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
):
    """``positions[i] = base[d, block] + in-block rank``; 1-D rows copied to ``send``."""
    block = tl.program_id(0).to(tl.int64)
    i = block * BLOCK + tl.arange(0, BLOCK)
    di, ok = _load_dest(src, i, i < n, W, rows_per_rank, MODE)
    before = tl.full([BLOCK], 0, tl.int32)
    for j0 in range(0, BLOCK, SUB):
        j = block * BLOCK + j0 + tl.arange(0, SUB)
        dj, okj = _load_dest(src, j, j < n, W, rows_per_rank, MODE)
        same = (di[:, None] == dj[None, :]) & okj[None, :] & (j[None, :] < i[:, None])
        before += count_true(same)
    pos = tl.load(base + di.to(tl.int64) * n_blocks + block, mask=ok, other=0) + before
    tl.store(positions + i, pos, mask=ok)
    if COPY:
        v = tl.load(values + i, mask=ok)
        if LOCAL:
            _, local = owner_and_local(v.to(tl.int64), W, rows_per_rank, MODE == 2)
            v = local.to(v.dtype)
        tl.store(send + pos, v, mask=ok)


# ---- launchers ------------------------------------------------------------
def ranged_dispatch_triton(
    values: Tensor, dest: Tensor, world_size: int, *, block: int | None = None
) -> tuple[Tensor, DispatchPlan]:
    """Triton twin of `ranged_dispatch_reference`."""
    return _dispatch(dest.contiguous(), DEST_GIVEN, values, world_size, 1, False, block)


def ranged_dispatch_ids_triton(
    ids: Tensor, sharding: RowSharding, local: bool, *, block: int | None = None
) -> tuple[Tensor, DispatchPlan]:
    """Ids grouped by owner, owners computed in the kernels."""
    mode = DEST_HASHED if sharding.scheme == "hashed" else DEST_BLOCK
    ids = ids.contiguous()
    rows = max(1, sharding.rows_per_rank)
    return _dispatch(ids, mode, ids, sharding.world_size, rows, local, block)


def block_size(world_size: int) -> int:
    """Rows per program: balances in-block compares against histogram size."""
    return min(1024, max(64, triton.next_power_of_2(math.isqrt(32 * world_size))))


def _dispatch(
    src: Tensor,
    mode: int,
    values: Tensor,
    W: int,
    rows_per_rank: int,
    local: bool,
    block: int | None,
) -> tuple[Tensor, DispatchPlan]:
    device, n = values.device, values.shape[0]
    BLOCK = block or block_size(W)
    SUB = max(1, min(BLOCK, TILE // BLOCK))
    n_blocks = cdiv(n, BLOCK)
    hist = torch.zeros(W * n_blocks, dtype=torch.int32, device=device)
    positions = torch.empty(n, dtype=torch.int64, device=device)
    copy = values.dim() == 1
    send = torch.empty_like(values, memory_format=torch.contiguous_format) if copy else values
    args = (n, W, rows_per_rank, n_blocks)
    if n:
        check_launchable(_count_kernel, device)
        _count_kernel[(n_blocks,)](src, hist, *args, MODE=mode, BLOCK=BLOCK, SUB=SUB)
    base = torch.cumsum(hist, 0, dtype=torch.int64) - hist
    counts = hist.view(W, n_blocks).sum(1, dtype=torch.int64)
    if n:
        vals, out = as_words(values.contiguous(), send) if copy else (values, values)
        _place_kernel[(n_blocks,)](
            src,
            vals,
            base,
            positions,
            out,
            *args,
            MODE=mode,
            COPY=copy,
            LOCAL=local,
            BLOCK=BLOCK,
            SUB=SUB,
        )
        if not copy:
            send = scatter_rows(values, positions)
    return send, DispatchPlan.from_counts(counts, positions)


# ---- check and GB/s -------------------------------------------------------
def check(device: str = "cuda", n: int = 100_000, world_size: int = 128, dim: int = 128) -> None:
    """Ids and embedding rows against the reference (raises on mismatch)."""
    dest = torch.randint(0, world_size, (n,), device=device)
    for values in (
        torch.randint(0, 2**40, (n,), device=device),
        torch.randn(n, dim, device=device),
    ):
        send, plan = ranged_dispatch_triton(values, dest, world_size)
        ref_send, ref = ranged_dispatch_reference(values, dest, world_size)
        assert torch.equal(send, ref_send) and torch.equal(plan.positions, ref.positions)
        assert torch.equal(plan.counts, ref.counts) and torch.equal(plan.offsets, ref.offsets)


def bench(n: int = 512_000, world_size: int = 512, dim: int = 128) -> dict[str, float]:
    """Milliseconds and GB/s for embedding rows on CUDA."""
    dest = torch.randint(0, world_size, (n,), device="cuda")
    rows = torch.randn(n, dim, device="cuda")
    ms = bench_ms(lambda: ranged_dispatch_triton(rows, dest, world_size))
    ref_ms = bench_ms(lambda: ranged_dispatch_reference(rows, dest, world_size))
    return {"ms": ms, "torch_ms": ref_ms, "gbps": gbps(dispatch_bytes(rows, 8), ms)}


if __name__ == "__main__":
    check()
    print(bench())
