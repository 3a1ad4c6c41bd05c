"""Triton collision split: position of every row of one sorted set in the other.

Reference: `freescale.kernels.collision.collision_split_reference`
(``torch.searchsorted`` both ways, then an equality check).

Element-parallel: a program takes ``BLOCK`` needles and runs a vectorized
lower-bound binary search over the other set (``ceil(log2(n + 1))`` steps,
the haystack stays in L2), then keeps the position only on an exact match.
One launch serves both directions: programs ``[0, a)`` search ``rows_now`` in
``rows_next`` and the rest search ``rows_next`` in ``rows_now``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freescale.kernels.collision import (
    CollisionSplit,
    collision_bytes,
    collision_split_reference,
)
from freescale.kernels.triton_common import (
    bench_ms,
    cdiv,
    check_launchable,
    gbps,
    search_steps,
)

BLOCK = 512


# ---- kernel ---------------------------------------------------------------
@triton.jit
def _find(needles, hay, out, i, n_needles, n_hay, n_steps):
    """``out[i]`` = position of ``needles[i]`` in sorted ``hay`` or -1."""
    mask = i < n_needles
    x = tl.load(needles + i, mask=mask, other=0)
    lo = tl.full(i.shape, 0, tl.int64)
    hi = lo + n_hay
    for _ in range(n_steps):  # lower bound: first k with hay[k] >= x
        active = lo < hi
        mid = (lo + hi) >> 1
        smaller = tl.load(hay + mid, mask=mask & active, other=0) < x
        lo = tl.where(active & smaller, mid + 1, lo)
        hi = tl.where(active & ~smaller, mid, hi)
    inside = mask & (lo < n_hay)
    hit = inside & (tl.load(hay + lo, mask=inside, other=0) == x)
    tl.store(out + i, tl.where(hit, lo, -1), mask=mask)


@triton.jit(do_not_specialize=["n_now", "n_next", "steps_next", "steps_now", "blocks_now"])
def _collision_kernel(
    now,
    nxt,
    now_to_next,
    next_to_now,
    n_now,
    n_next,
    steps_next,
    steps_now,
    blocks_now,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < blocks_now:
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        _find(now, nxt, now_to_next, i, n_now, n_next, steps_next)
    else:
        i = (pid - blocks_now).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        _find(nxt, now, next_to_now, i, n_next, n_now, steps_now)


# ---- launcher -------------------------------------------------------------
def collision_split_triton(rows_now: Tensor, rows_next: Tensor) -> CollisionSplit:
    """Triton twin of `collision_split_reference`."""
    now, nxt = rows_now.contiguous(), rows_next.contiguous()
    n_now, n_next = now.numel(), nxt.numel()
    now_to_next = torch.empty(n_now, dtype=torch.int64, device=now.device)
    next_to_now = torch.empty(n_next, dtype=torch.int64, device=now.device)
    blocks_now, blocks_next = cdiv(n_now, BLOCK), cdiv(n_next, BLOCK)
    if blocks_now + blocks_next:
        check_launchable(_collision_kernel, now.device)
        _collision_kernel[(blocks_now + blocks_next,)](
            now,
            nxt,
            now_to_next,
            next_to_now,
            n_now,
            n_next,
            search_steps(n_next),
            search_steps(n_now),
            blocks_now,
            BLOCK=BLOCK,
        )
    return CollisionSplit(rows_now, rows_next, now_to_next, next_to_now)


# ---- check and GB/s -------------------------------------------------------
def random_sets(n: int, overlap: float, device: str, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Two sorted unique sets of about ``n`` rows sharing about ``overlap * n``."""
    g = torch.Generator().manual_seed(seed)
    universe = torch.randperm(4 * n, generator=g)
    shared = int(overlap * n)
    now = torch.unique(universe[:n])
    nxt = torch.unique(torch.cat([universe[:shared], universe[n : 2 * n - shared]]))
    return now.to(device), nxt.to(device)


def check(device: str = "cuda", n: int = 100_000) -> None:
    """int32 and int64 rows against the reference (raises on mismatch)."""
    for dtype in (torch.int32, torch.int64):
        now, nxt = (t.to(dtype) for t in random_sets(n, 0.3, device))
        got, want = collision_split_triton(now, nxt), collision_split_reference(now, nxt)
        assert torch.equal(got.now_to_next, want.now_to_next)
        assert torch.equal(got.next_to_now, want.next_to_now)


def bench(n: int = 300_000) -> dict[str, float]:
    """Milliseconds and GB/s on CUDA."""
    now, nxt = random_sets(n, 0.3, "cuda")
    ms = bench_ms(lambda: collision_split_triton(now, nxt))
    ref_ms = bench_ms(lambda: collision_split_reference(now, nxt))
    return {"ms": ms, "torch_ms": ref_ms, "gbps": gbps(collision_bytes(n, n, 8), ms)}


if __name__ == "__main__":
    check()
    print(bench())
