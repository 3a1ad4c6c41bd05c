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
    count,
    gbps,
    search_steps,
)

BLOCK = 512


# ---- kernel ---------------------------------------------------------------
@triton.jit
def _search(x, mask, hay, n_hay, n_steps):
    """(lower bound of each ``x`` in sorted ``hay``, whether ``hay`` holds it there)."""
    lo = tl.full(x.shape, 0, tl.int64)
    hi = lo + n_hay
    for _ in range(n_steps):  # lower bound: first k with hay[k] >= x
        active = lo < hi
        mid = (lo + hi) >> 1
        smaller = tl.load(hay + mid, mask=mask & active, other=0) < x
        lo = tl.where(active & smaller, mid + 1, lo)
        hi = tl.where(active & ~smaller, mid, hi)
    inside = mask & (lo < n_hay)
    return lo, inside & (tl.load(hay + lo, mask=inside, other=0) == x)


@triton.jit
def _find(needles, hay, out, i, n_needles, n_hay, n_steps):
    """``out[i]`` = position of ``needles[i]`` in sorted ``hay`` or -1."""
    mask = i < n_needles
    x = tl.load(needles + i, mask=mask, other=0)
    lo, hit = _search(x, mask, hay, n_hay, n_steps)
    tl.store(out + i, tl.where(hit, lo, -1), mask=mask)


@triton.jit
def _mark(needles, hay, out, i, n_needles, n_hay, n_steps):
    """``out[i]`` = whether ``needles[i]`` is in sorted ``hay`` (bytes); the hit count."""
    mask = i < n_needles
    x = tl.load(needles + i, mask=mask, other=0)
    hit = _search(x, mask, hay, n_hay, n_steps)[1]
    tl.store(out + i, hit.to(tl.uint8), mask=mask)
    return count(hit)


@triton.jit(do_not_specialize=["n_now", "n_next", "steps_next", "steps_now", "blocks_now",
                               "blocks_next"])  # fmt: skip
def _marks_kernel(
    now, nxt, sorted_now, sorted_next, now_mark, next_mark, stats,
    n_now, n_next, steps_next, steps_now, blocks_now, blocks_next, BLOCK: tl.constexpr,
):  # fmt: skip
    """Programs [0, a): ``now`` in ``sorted_next``; [a, a + b): ``nxt`` in
    ``sorted_now`` (+ its hit count); the rest: the distinct rows of
    ``sorted_next`` (+ how many are in ``sorted_now``). Integer atomics: exact."""
    pid = tl.program_id(0)
    if pid == 0:
        tl.store(stats + 3, n_next.to(tl.int64))
    if pid < blocks_now:
        i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        _mark(now, sorted_next, now_mark, i, n_now, n_next, steps_next)
    elif pid < blocks_now + blocks_next:
        i = (pid - blocks_now).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        tl.atomic_add(stats + 2, _mark(nxt, sorted_now, next_mark, i, n_next, n_now, steps_now))
    else:
        i = (pid - blocks_now - blocks_next).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n_next
        x = tl.load(sorted_next + i, mask=mask, other=0)
        before = tl.load(sorted_next + i - 1, mask=mask & (i > 0), other=0)
        first = mask & ((i == 0) | (x != before))  # a run of equal slots starts here
        hit = _search(x, first, sorted_now, n_now, steps_now)[1]
        tl.atomic_add(stats + 0, count(hit))
        tl.atomic_add(stats + 1, count(first))


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


def owner_marks_triton(
    slots_now: Tensor, slots_next: Tensor, sorted_now: Tensor, sorted_next: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """Triton twin of `freescale.embedding.collision_link.owner_marks` (given
    both steps' slots sorted): one launch for the marks and the stats."""
    n_now, n_next = slots_now.numel(), slots_next.numel()
    device = slots_now.device
    now_mark = torch.empty(n_now, dtype=torch.uint8, device=device)
    next_mark = torch.empty(n_next, dtype=torch.uint8, device=device)
    stats = torch.zeros(4, dtype=torch.int64, device=device)
    blocks_now, blocks_next = cdiv(n_now, BLOCK), cdiv(n_next, BLOCK)
    if blocks_now + blocks_next:
        check_launchable(_marks_kernel, device)
        _marks_kernel[(blocks_now + 2 * blocks_next,)](
            slots_now.contiguous(), slots_next.contiguous(), sorted_now, sorted_next,
            now_mark, next_mark, stats, n_now, n_next, search_steps(n_next),
            search_steps(n_now), blocks_now, blocks_next, BLOCK=BLOCK,
        )  # fmt: skip
    return now_mark.view(torch.bool), next_mark.view(torch.bool), stats


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
