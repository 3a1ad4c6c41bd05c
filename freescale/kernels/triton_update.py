"""Triton sparse row update: duplicate-gradient sums and the optimizer step, no host sync.

Reference: `freescale.embedding._ops.sum_duplicates` then
`freescale.embedding.optim.apply_rows`. That path asks the host for the
number of unique rows (and for the longest run, to chunk hot rows), so the
host waits for the GPU in the middle of backward. Here every size is the
number of received ids ``N``, known on the host; the unique rows are never
counted (one program per position, active where a run starts):

1. torch: stable sort of the slots (``sorted``, ``order``); a *run* is a
   stretch of equal slots. Each run is cut into *pieces* of ``CHUNK``
   positions counted from the run's own start. Run bounds are found in the
   kernels (a position starts a run when its slot differs from the one
   before; its ends by galloping search in ``sorted``), so nothing
   but the sort and two launches is issued from the host (~20 small torch
   ops per update did this before: most of the update's host time);
2. ``piece_sums``: program ``c`` owns the pieces that *start* in positions
   ``[c * CHUNK, (c + 1) * CHUNK)``; it adds each one's gradient rows in
   position order and writes the sum at the piece's first position. A piece
   is at most ``CHUNK`` long, so a program scans at most ``2 * CHUNK``
   positions;
3. ``apply``: one program per position; the one at a run's start adds the
   run's piece sums (the first, then tiles of ``FAN`` pieces, so a hot row
   of a million duplicates costs ``1e6 / CHUNK`` adds) and applies the
   optimizer to that row in fp32; the others do nothing.

Every sum runs in a fixed order that depends only on the run's own
contributions (their number and order), not on where the run starts among
the ``N`` positions: bitwise reproducible, and updating a set of rows in two
disjoint parts (prioritized updates: collision rows, then exclusive rows) is
bitwise one update of all of them. With pieces cut at absolute positions, a
row's sum would depend on the rows sorted before it. The chunking differs
from the reference's, so the two agree to rounding, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freescale.kernels.triton_common import cdiv, check_launchable, next_pow2

CHUNK = 32
KINDS = {"sgd": 0, "rowwise_adagrad": 1, "adam": 2}
# Weight decay (`freescale.embedding.optim`): 0 = none, the code of an undecayed update.
DECAY_MODES = {"l2": 1, "decoupled": 2}


# ---- kernels --------------------------------------------------------------
@triton.jit
def _bound(sorted_slots, lo, hi, v, ABOVE: tl.constexpr):
    """First position in ``[lo, hi)`` whose slot is not below ``v`` (``ABOVE``:
    above ``v``); ``hi`` if none."""
    while lo < hi:
        mid = lo + (hi - lo) // 2
        x = tl.load(sorted_slots + mid)
        before = (x <= v) if ABOVE else (x < v)
        lo = tl.where(before, mid + 1, lo)
        hi = tl.where(before, hi, mid)
    return lo


# Most runs are a few positions long, so both ends are found by galloping
# (probes 1, 2, 4, ... positions away, then a binary search between the last
# two): about 2 log2(run length) loads, one for a run of one.
@triton.jit
def _run_start(sorted_slots, p, v):
    """First position of the run holding ``v`` at position ``p``."""
    hi = p  # positions >= hi (up to p) are in the run
    q = p - 1
    step = p * 0 + 1
    inside = tl.load(sorted_slots + q, mask=q >= 0, other=-1) == v
    while inside:
        hi = q
        step = step * 2
        q = hi - step
        inside = tl.load(sorted_slots + q, mask=q >= 0, other=-1) == v
    return _bound(sorted_slots, tl.maximum(q + 1, 0), hi, v, False)


@triton.jit
def _run_end(sorted_slots, p, v, n):
    """One past the last position of the run holding ``v`` at position ``p``."""
    lo = p + 1  # positions < lo (from p) are in the run
    q = lo
    step = p * 0 + 1
    inside = tl.load(sorted_slots + q, mask=q < n, other=-1) == v
    while inside:
        lo = q + 1
        step = step * 2
        q = lo + step - 1
        inside = tl.load(sorted_slots + q, mask=q < n, other=-1) == v
    return _bound(sorted_slots, lo, tl.minimum(q, n), v, True)


@triton.jit(do_not_specialize=["n"])
def _piece_sums_kernel(
    order, sorted_slots, grads, partial, n, D, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr
):
    p0 = tl.program_id(0).to(tl.int64) * CHUNK
    cols = tl.arange(0, BLOCK_D)
    cm = cols < D
    acc = tl.full([BLOCK_D], 0.0, tl.float32)
    start = p0 - 1  # first position of the piece being summed; < p0: none yet
    prev = tl.load(sorted_slots + p0)
    run = _run_start(sorted_slots, p0, prev)  # start of the run at the current position
    for k in range(2 * CHUNK):
        p = p0 + k
        valid = p < n
        slot = tl.load(sorted_slots + p, mask=valid, other=-1)
        run = tl.where(slot != prev, p, run)
        prev = slot
        # Pieces start every CHUNK positions from their run's start.
        if valid & ((p - run) % CHUNK == 0):
            if start >= p0:
                tl.store(partial + start * D + cols, acc, mask=cm)
            acc = tl.full([BLOCK_D], 0.0, tl.float32)
            # Pieces starting past this program's window belong to the next one.
            start = tl.where(k < CHUNK, p, p0 - 1)
        mine = valid & (start >= p0)
        src = tl.load(order + p, mask=mine, other=0)
        acc += tl.load(grads + src * D + cols, mask=cm & mine, other=0.0).to(tl.float32)
    if start >= p0:
        tl.store(partial + start * D + cols, acc, mask=cm)


@triton.jit(do_not_specialize=["n", "frozen_count", "bounds_count"])
def _apply_kernel(
    sorted_slots,
    n,
    frozen,
    frozen_count,
    skip,
    partial,
    weight,
    state1,
    state2,
    lr_tables,
    b1_tables,
    b2_tables,
    table_bounds,
    bounds_count,
    lr,
    bc1,
    bc2,
    eps,
    beta1,
    beta2,
    weight_decay,
    D,
    D_f,
    KIND: tl.constexpr,
    DECAY: tl.constexpr,
    PER_ROW: tl.constexpr,
    SKIP: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FAN: tl.constexpr,
):
    p0 = tl.program_id(0).to(tl.int64)
    r = tl.load(sorted_slots + p0).to(tl.int64)  # int32 keys: r * D must not overflow
    act = tl.load(sorted_slots + p0 - 1, mask=p0 > 0, other=-1) != r  # a run starts here
    if SKIP:  # the step's non-finite flag, read on the device
        act = act & (tl.load(skip) == 0)
    # Frozen (padding) slots are few: a scan, and only where a run starts.
    for i in range(0, tl.where(act, frozen_count, 0)):
        act = act & (tl.load(frozen + i) != r)
    if act:
        cols = tl.arange(0, BLOCK_D)
        cm = cols < D
        p1 = _run_end(sorted_slots, p0, r, n)
        g = tl.load(partial + p0 * D + cols, mask=cm, other=0.0)
        # The other pieces start every CHUNK positions from the run's start; a
        # hot row has many: load FAN of them at once (a chain of single loads
        # would pay the memory latency once per piece) and add the tile's sum.
        p = p0 + CHUNK
        k = tl.arange(0, FAN)
        while p < p1:
            q = p + k * CHUNK
            tile = tl.load(
                partial + q[:, None] * D + cols[None, :],
                mask=(q < p1)[:, None] & cm[None, :],
                other=0.0,
            )
            g += tl.reduce(tile, 0, _add)
            p += FAN * CHUNK
        if PER_ROW:  # the slot's table: how many tables start at or before it
            t = r * 0
            for i in range(0, bounds_count):
                t += (tl.load(table_bounds + i) <= r).to(tl.int64)
            lr = tl.load(lr_tables + t)
            bc1 = tl.load(b1_tables + t)
            bc2 = tl.load(b2_tables + t)
        wp = weight + r * D + cols
        w = tl.load(wp, mask=cm, other=0.0).to(tl.float32)
        if KIND == 1:
            s0 = tl.load(state1 + r)
        elif KIND == 2:
            m0 = tl.load(state1 + r * D + cols, mask=cm)
            v0 = tl.load(state2 + r * D + cols, mask=cm)
        # Warps hold copies of the row (and all of them the scalar state): none
        # may store before every one has loaded, or a late load reads the new
        # value and updates twice (seen on an H200: ~4 % of Adagrad updates of
        # 400k ids had one row off; docs/LOG.md, "a race in the apply kernel").
        tl.debug_barrier()
        if DECAY == 1:  # L2: the decay term joins the gradient
            g = g + weight_decay * w
        if KIND == 0:
            new = w - lr * g
        elif KIND == 1:
            s = s0 + tl.div_rn(tl.reduce(g * g, 0, _add), D_f)
            tl.store(state1 + r, s)
            new = w - tl.div_rn(lr * g, tl.sqrt_rn(s) + eps)
        else:
            m = beta1 * m0 + (1.0 - beta1) * g
            v = beta2 * v0 + (1.0 - beta2) * (g * g)
            tl.store(state1 + r * D + cols, m, mask=cm)
            tl.store(state2 + r * D + cols, v, mask=cm)
            denom = tl.sqrt_rn(tl.div_rn(v, bc2)) + eps
            new = w - tl.div_rn(lr * tl.div_rn(m, bc1), denom)
        if DECAY == 2:  # decoupled: shrink the old row, apart from the optimizer
            new = new - lr * weight_decay * w
        tl.store(wp, new.to(weight.dtype.element_ty), mask=cm)


@triton.jit
def _add(a, b):
    return a + b


# ---- launcher -------------------------------------------------------------
def fan(block_d: int) -> int:
    """Pieces a hot row's program loads at once: a tile of about 4K floats."""
    return max(1, 4096 // block_d)


def sparse_update(
    weight: Tensor,
    state: list[Tensor],
    slots: Tensor,
    grads: Tensor,
    kind: str,
    lr: float | Tensor,
    bc: tuple[float | Tensor, float | Tensor],
    eps: float = 0.0,
    betas: tuple[float, float] = (0.0, 0.0),
    weight_decay: float = 0.0,
    decay_mode: str = "l2",
    frozen: Tensor | None = None,
    table_bounds: Tensor | None = None,
    skip: Tensor | None = None,
) -> None:
    """``weight[slot] -= optimizer(sum of grads of slot)`` for every received slot.

    ``state``: the optimizer's fp32 state tensors in `KINDS` order (none for
    SGD, the per-row accumulator for row-wise Adagrad, the two moments for
    Adam). ``lr``/``bc``: floats, or per-table ``[T]`` tensors; then a slot's
    table is found by bucketizing it into ``table_bounds`` (the first slot of
    every table but the first). ``frozen``: slots never updated (padding rows).
    ``skip``: a 0-dim device flag; when true no row changes (read on the device).
    ``weight_decay`` / ``decay_mode``: as in `freescale.embedding.optim`.
    """
    n, D = grads.shape[0], weight.shape[1]
    if n == 0:
        return
    # On the slots' device: the weight and state may be pinned host memory
    # (the host tier), which the kernel reads and writes over PCIe.
    check_launchable(_apply_kernel, slots.device)
    # 32-bit keys where the table allows: half the radix sort's passes, same order.
    keys = slots.to(torch.int32) if weight.shape[0] <= torch.iinfo(torch.int32).max else slots
    sorted_slots, order = torch.sort(keys, stable=True)
    partial = torch.empty((n, D), dtype=torch.float32, device=slots.device)
    BLOCK_D = next_pow2(D)
    _piece_sums_kernel[(cdiv(n, CHUNK),)](
        order, sorted_slots, grads.contiguous(), partial, n, D, CHUNK=CHUNK, BLOCK_D=BLOCK_D
    )
    per_row = isinstance(lr, Tensor)
    if per_row:
        assert table_bounds is not None, "per-table lr needs table_bounds"
        lr_t, b1_t, b2_t = (x.to(torch.float32) for x in (lr, *bc))
        lr_s = b1_s = b2_s = 1.0
    else:
        lr_t = b1_t = b2_t = partial  # unused
        table_bounds = sorted_slots  # unused
        lr_s, b1_s, b2_s = float(lr), float(bc[0]), float(bc[1])
    frozen_count = 0 if frozen is None else frozen.numel()
    s1 = state[0] if state else weight
    s2 = state[1] if len(state) > 1 else weight
    _apply_kernel[(n,)](
        sorted_slots,
        n,
        frozen if frozen_count else sorted_slots,
        frozen_count,
        sorted_slots if skip is None else skip.view(torch.uint8),  # bytes: no i1 pointer
        partial,
        weight,
        s1,
        s2,
        lr_t,
        b1_t,
        b2_t,
        table_bounds,
        table_bounds.numel() if per_row else 0,
        lr_s,
        b1_s,
        b2_s,
        float(eps),
        float(betas[0]),
        float(betas[1]),
        float(weight_decay),
        D,
        float(D),
        KIND=KINDS[kind],
        DECAY=DECAY_MODES[decay_mode] if weight_decay else 0,
        PER_ROW=per_row,
        SKIP=skip is not None,
        CHUNK=CHUNK,
        BLOCK_D=BLOCK_D,
        FAN=fan(BLOCK_D),
    )
