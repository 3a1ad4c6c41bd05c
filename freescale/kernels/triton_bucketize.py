"""Triton bucketize-by-shard: owner rank and local row of every id.

Reference: `freescale.kernels.shard.bucketize_reference` (`RowSharding.locate`;
the formulas are in that module's docstring). One fused elementwise pass: the torch reference runs
about ten elementwise kernels for the hashed scheme, each re-reading the ids.
`owner_and_local` is reused inside the dispatch kernel so that owners are never
materialized there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freescale.kernels.shard import RowSharding, bucketize_bytes, bucketize_reference
from freescale.kernels.triton_common import bench_ms, cdiv, check_launchable, gbps

BLOCK = 1024


# ---- kernel ---------------------------------------------------------------
@triton.jit
def stripe_hash(g):
    """`freescale.kernels.shard.stripe_hash` of int64 ``g`` (products stay below 2**58)."""
    x = g & 0x7FFFFFFF
    x = (x * 0x45D9F3B) & 0x7FFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & 0x7FFFFFFF
    return x ^ (x >> 16)


@triton.jit
def owner_and_local(x, W, per, B, HASHED: tl.constexpr):
    """Owner rank and local row of int64 ids ``x >= 0``: ``per`` slots per rank
    (block), ``B`` ids per block of a stripe (hashed); `RowSharding.locate`."""
    if HASHED:
        span = B * W
        stripe = x // span
        within = x - stripe * span
        block = within // B
        owner = (block + stripe_hash(stripe)) % W
        local = stripe * B + (within - block * B)
    else:
        owner = x // per
        local = x - owner * per
    return owner, local


def sharding_args(sharding: RowSharding) -> tuple[int, int, int]:
    """``(W, per, B)`` of `owner_and_local` (B = 1 is specialized by Triton)."""
    return sharding.world_size, sharding.local_rows, sharding.block_size


@triton.jit(do_not_specialize=["n"])
def _bucketize_kernel(ids, owner, local, n, W, per, B, HASHED: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    x = tl.load(ids + i, mask=mask, other=0)
    o, loc = owner_and_local(x.to(tl.int64), W, per, B, HASHED)
    tl.store(owner + i, o, mask=mask)
    tl.store(local + i, loc.to(x.dtype), mask=mask)


# ---- launcher -------------------------------------------------------------
def bucketize_triton(ids: Tensor, sharding: RowSharding) -> tuple[Tensor, Tensor]:
    """Triton twin of `bucketize_reference`."""
    ids = ids.contiguous()
    owner = torch.empty(ids.shape, dtype=torch.int64, device=ids.device)
    local = torch.empty_like(ids)
    n = ids.numel()
    if n:
        check_launchable(_bucketize_kernel, ids.device)
        _bucketize_kernel[(cdiv(n, BLOCK),)](
            ids,
            owner,
            local,
            n,
            *sharding_args(sharding),
            HASHED=sharding.kind == "hashed",
            BLOCK=BLOCK,
        )
    return owner, local


# ---- check and GB/s -------------------------------------------------------
def check(device: str = "cuda", n: int = 100_000) -> None:
    """Both kinds, block sizes 1 and 3, int32 and int64 ids, against the reference."""
    for scheme, bs in (("block", 1), ("hashed", 1), ("hashed", 3)):
        for dtype in (torch.int32, torch.int64):
            sharding = RowSharding(10_000_019, 96, scheme, bs)
            ids = torch.randint(0, sharding.rows, (n,), dtype=dtype, device=device)
            ids[:2] = torch.tensor([0, sharding.rows - 1])
            got, want = bucketize_triton(ids, sharding), bucketize_reference(ids, sharding)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), scheme


def bench(n: int = 512_000, world_size: int = 512) -> dict[str, float]:
    """Milliseconds and GB/s of the hashed scheme on CUDA."""
    sharding = RowSharding(100_000_000, world_size, "hashed")
    ids = torch.randint(0, sharding.rows, (n,), device="cuda")
    ms = bench_ms(lambda: bucketize_triton(ids, sharding))
    ref_ms = bench_ms(lambda: bucketize_reference(ids, sharding))
    return {"ms": ms, "torch_ms": ref_ms, "gbps": gbps(bucketize_bytes(n, 8), ms)}


if __name__ == "__main__":
    check()
    print(bench())
