"""Triton building blocks of the fused jagged HSTU attention: bucketing, the
relative bias and its gradient, row addressing, and which block a program runs.
The kernels are `triton_hstu_fwd` and `triton_hstu_bwd`; `hstu` launches them.

Per sample with ``L`` history rows and ``C`` candidate rows, the *rows* of the
sample are its history rows ``0..L-1`` then its candidates ``L..L+C-1`` (read
from the two packed tensors in place: no concatenation). Row ``r`` attends to
key ``j < L`` when ``j <= r`` (history: causal) or ``r >= L`` (a candidate sees
the whole history; its attention to itself is the caller's). For one head::

    s = α·q_r·k_j + P[pos(|min(r, L) - j|)] + T[time(|t_r - t_j|)]
    out_r = (1/(L+1)) · Σ_j SiLU(s)·v_j

with the bucket function `bucket` (exact integer arithmetic, the same as
`hstu.log_buckets`). Programs are dealt longest sample first, heaviest block
first (`find`, `query_block`), so one long history is spread over many
programs and starts early.

A head dim below 16 (or not a power of two) is padded to ``D`` with masked
loads. Kernels use Triton builtins only (see `triton_common`), so the CPU
interpreter runs them.
"""

from __future__ import annotations

import triton
import triton.language as tl

from freescale.kernels.attention import hstu as spec

# The two bucket schemes (`hstu.POSITION` / `TIME`) as kernel constants.
P_EXACT: tl.constexpr = tl.constexpr(spec.POSITION.exact)
P_SQUARE: tl.constexpr = tl.constexpr(spec.POSITION.per_octave == 2)
P_NB: tl.constexpr = tl.constexpr(spec.POSITION.count)
P_CAP: tl.constexpr = tl.constexpr(spec.POSITION.cap)
T_EXACT: tl.constexpr = tl.constexpr(spec.TIME.exact)
T_SQUARE: tl.constexpr = tl.constexpr(spec.TIME.per_octave == 2)
T_NB: tl.constexpr = tl.constexpr(spec.TIME.count)
T_CAP: tl.constexpr = tl.constexpr(spec.TIME.cap)
I64_MAX: tl.constexpr = tl.constexpr(2**63 - 1)


@triton.jit
def floor_log2(y):
    """floor(log2(y)) of int32 ``y >= 1``, exactly: the float's exponent, one
    less where rounding to float carried ``y`` up to the next power of two."""
    e = ((y.to(tl.float32).to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return e - ((y >> e) == 0).to(tl.int32)


@triton.jit
def bucket(x, EXACT: tl.constexpr, SQUARE: tl.constexpr, NB: tl.constexpr, CAP: tl.constexpr):
    """Bucket of int ``x >= 0``: ``x`` below EXACT, then EXACT + floor(p·log2(x/EXACT))
    with p = 2 if SQUARE else 1, at most NB - 1 (``x`` is clamped to CAP first)."""
    x = tl.maximum(tl.minimum(x, CAP), 0).to(tl.int32)
    y = (x * x) // (EXACT * EXACT) if SQUARE else x // EXACT
    far = EXACT + floor_log2(tl.maximum(y, 1))
    return tl.where(x < EXACT, x, tl.minimum(far, NB - 1))


@triton.jit
def pos_bucket(x):
    return bucket(x, P_EXACT, P_SQUARE, P_NB, P_CAP)


@triton.jit
def time_bucket(x):
    return bucket(x, T_EXACT, T_SQUARE, T_NB, T_CAP)


@triton.jit
def sigmoid(x, FAST: tl.constexpr):
    """σ(x); FAST: 0.5 + 0.5·tanh(x/2) with one tanh.approx (one special-function
    op instead of an exp and a division; relative error about 2^-11)."""
    if FAST:
        t = tl.inline_asm_elementwise(
            "tanh.approx.f32 $0, $1;", "=r,r", [x * 0.5], dtype=tl.float32, is_pure=True, pack=1
        )
        return 0.5 + 0.5 * t
    else:
        return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def rmin(x):
    return tl.reduce(x, 0, tl.standard._elementwise_min)


@triton.jit
def rmax(x):
    return tl.reduce(x, 0, tl.standard._elementwise_max)


@triton.jit
def sum_all(x):
    return tl.reduce(tl.reduce(x, 1, tl.standard._sum_combine), 0, tl.standard._sum_combine)


@triton.jit
def find(BLOCK_START, ORDER, n_samples, pid):
    """(sample, block index within it, its block count) of program ``pid`` (which
    must be below the total); BLOCK_START[s] is the first block of the s-th
    sample dealt, ORDER[s] that sample."""
    lo = n_samples * 0
    hi = lo + n_samples
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(BLOCK_START + mid) <= pid:
            lo = mid
        else:
            hi = mid
    first = tl.load(BLOCK_START + lo)
    return tl.load(ORDER + lo), pid - first, tl.load(BLOCK_START + lo + 1) - first


@triton.jit
def rows(PU, su, suh, PC, sc, sch, h, r, L, u0, c0, d):
    """Pointers [BM, D] of rows ``r`` of head ``h``: history rows in PU, candidates in PC."""
    pu = PU + (u0 + r)[:, None] * su + h * suh + d[None, :]
    pc = PC + (c0 + r - L)[:, None] * sc + h * sch + d[None, :]
    return tl.where((r < L)[:, None], pu, pc)


@triton.jit
def row_times(r, L, C, u0, c0, T_u, T_c):
    """Times of rows ``r`` (history or candidate), and which rows exist."""
    is_u = r < L
    is_c = (r >= L) & (r < L + C)
    tu = tl.load(T_u + u0 + r, mask=is_u, other=0)
    tc = tl.load(T_c + c0 + r - L, mask=is_c, other=0)
    return tl.where(is_u, tu, tc), is_u | is_c


@triton.jit
def abs_range(lo, hi):
    """[min, max] of |v| over v in [lo, hi]."""
    a = tl.where(lo >= 0, lo, tl.where(hi <= 0, -hi, 0))
    return a, tl.maximum(tl.abs(lo), tl.abs(hi))


@triton.jit
def ranges(pr_lo, pr_hi, j_lo, j_hi, tr_lo, tr_hi, tj_lo, tj_hi):
    """The position and time buckets a tile spans: (first, last) of each."""
    pa, pb = abs_range(pr_lo - j_hi, pr_hi - j_lo)
    ta, tb = abs_range(tr_lo - tj_hi, tr_hi - tj_lo)
    return pos_bucket(pa), pos_bucket(pb), time_bucket(ta), time_bucket(tb)


@triton.jit
def beyond(pr, j, PTHR, b):
    """Tile mask: |relative position| >= the first value of position bucket b."""
    return tl.abs(pr[:, None] - j[None, :]) >= tl.load(PTHR + b)


@triton.jit
def later(tr, tj, TTHR, b):
    """Tile mask: |time difference| >= the first value of time bucket b (no per-element
    subtraction: t_j <= t_r - thr or t_j >= t_r + thr)."""
    thr = tl.load(TTHR + b)
    return (tj[None, :] <= (tr - thr)[:, None]) | (tj[None, :] >= (tr + thr)[:, None])


@triton.jit
def add_bias(s, pr, j, tr, tj, p_lo, p_hi, t_lo, t_hi, POS, TIME, PTHR, TTHR):
    """``s`` plus the relative bias: the tile's first buckets' values, then one
    masked step per bucket boundary inside the tile (none in most tiles far
    from the diagonal: no per-element bucket arithmetic or table gathers)."""
    s = s + (tl.load(POS + p_lo) + tl.load(TIME + t_lo))
    for b in range(p_lo + 1, p_hi + 1):
        step = tl.load(POS + b) - tl.load(POS + b - 1)
        s += tl.where(beyond(pr, j, PTHR, b), step, 0.0)
    for b in range(t_lo + 1, t_hi + 1):
        step = tl.load(TIME + b) - tl.load(TIME + b - 1)
        s += tl.where(later(tr, tj, TTHR, b), step, 0.0)
    return s


@triton.jit
def bias_grads(dpos, dtime, ds, pr, j, tr, tj, p_lo, p_hi, t_lo, t_hi, PTHR, TTHR):
    """Add the tile's ``ds`` to the bias tables' gradients: the sum of the
    elements at or past each boundary moves from one bucket to the next."""
    tot = sum_all(ds)
    slots_p = tl.arange(0, P_NB)
    slots_t = tl.arange(0, T_NB)
    dpos += tl.where(slots_p == p_lo, tot, 0.0)
    dtime += tl.where(slots_t == t_lo, tot, 0.0)
    for b in range(p_lo + 1, p_hi + 1):
        part = sum_all(tl.where(beyond(pr, j, PTHR, b), ds, 0.0))
        dpos += tl.where(slots_p == b, part, 0.0) - tl.where(slots_p == b - 1, part, 0.0)
    for b in range(t_lo + 1, t_hi + 1):
        part = sum_all(tl.where(later(tr, tj, TTHR, b), ds, 0.0))
        dtime += tl.where(slots_t == b, part, 0.0) - tl.where(slots_t == b - 1, part, 0.0)
    return dpos, dtime


@triton.jit
def key_times(T_u, u0, j, L):
    """Times of keys ``j`` and their range over the real keys."""
    ok = j < L
    tj = tl.load(T_u + u0 + j, mask=ok, other=0)
    return tj, rmin(tl.where(ok, tj, I64_MAX)), rmax(tl.where(ok, tj, -I64_MAX))


@triton.jit
def scores(q, k, alpha, PREC: tl.constexpr):
    return tl.dot(q, tl.trans(k), input_precision=PREC) * alpha


@triton.jit
def qrow_setup(r, L, C, u0, c0, T_u, T_c, HAS_BIAS: tl.constexpr):
    """Per query block: positions, times and their ranges (for the uniform-bias test)."""
    pr = tl.minimum(r, L)
    if HAS_BIAS:
        tr, tlive = row_times(r, L, C, u0, c0, T_u, T_c)
        tr_lo = rmin(tl.where(tlive, tr, I64_MAX))
        tr_hi = rmax(tl.where(tlive, tr, -I64_MAX))
    else:
        tr = r.to(tl.int64)
        tr_lo = rmin(tr)
        tr_hi = rmax(tr)
    return pr, tr, tr_lo, tr_hi


@triton.jit
def query_block(BLOCK_START, ORDER, UIH_OFF, CAND_OFF, n_samples, BM: tl.constexpr,
                 UIH_OUT: tl.constexpr):  # fmt: skip
    """(valid, u0, L, c0, C, first row) of this program's query block."""
    pid = tl.program_id(0)
    b, blk, nblk = find(BLOCK_START, ORDER, n_samples, pid)
    u0 = tl.load(UIH_OFF + b)
    L = (tl.load(UIH_OFF + b + 1) - u0).to(tl.int32)
    c0 = tl.load(CAND_OFF + b)
    C = (tl.load(CAND_OFF + b + 1) - c0).to(tl.int32)
    # The last (heaviest) block first; without history outputs rows start at L.
    r0 = (nblk - 1 - blk) * BM if UIH_OUT else L + (nblk - 1 - blk) * BM
    return u0, L, c0, C, r0.to(tl.int32)
