"""The forward Triton kernel of the fused jagged HSTU attention (the math and
the building blocks: `triton_hstu_tiles`): one program per query block and
head, every output row written by one program."""

from __future__ import annotations

import triton
import triton.language as tl

from freescale.kernels.attention.triton_hstu_tiles import (
    add_bias,
    key_times,
    qrow_setup,
    query_block,
    ranges,
    rows,
    scores,
    sigmoid,
)


@triton.jit(do_not_specialize=["n_samples", "alpha"])
def _fwd_kernel(
    Q_u, K_u, V_u, Q_c, O_u, O_c, T_u, T_c, UIH_OFF, CAND_OFF, ORDER, BLOCK_START, POS, TIME,
    PTHR, TTHR,
    sq_u, sq_uh, sk_u, sk_uh, sv_u, sv_uh, sq_c, sq_ch, so_u, so_uh, so_c, so_ch,
    n_samples, alpha, DH,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UIH_OUT: tl.constexpr,
    HAS_BIAS: tl.constexpr, FAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    if tl.program_id(0) >= tl.load(BLOCK_START + n_samples):
        return
    h = tl.program_id(1)
    u0, L, c0, C, r0 = query_block(BLOCK_START, ORDER, UIH_OFF, CAND_OFF, n_samples, BM, UIH_OUT)
    r = r0 + tl.arange(0, BM)
    d = tl.arange(0, D)
    dmask = (d < DH)[None, :]
    live = (r < L + C)[:, None] & dmask
    qp = rows(Q_u, sq_u, sq_uh, Q_c, sq_c, sq_ch, h, r, L, u0, c0, d)
    q = tl.load(qp, mask=live, other=0.0)
    pr, tr, tr_lo, tr_hi = qrow_setup(r, L, C, u0, c0, T_u, T_c, HAS_BIAS)
    pr_lo = tl.minimum(r0, L)
    pr_hi = tl.minimum(r0 + BM - 1, L)
    acc = tl.full((BM, D), 0.0, tl.float32)
    kend = tl.minimum(r0 + BM, L)
    full_end = (tl.minimum(r0 + 1, L) // BN) * BN
    kb = K_u + u0 * sk_u + h * sk_uh
    vb = V_u + u0 * sv_u + h * sv_uh
    # Key blocks every row of the block sees whole: no mask.
    for n0 in range(0, full_end, BN):
        j = n0 + tl.arange(0, BN)
        k = tl.load(kb + j[:, None] * sk_u + d[None, :], mask=dmask, other=0.0)
        v = tl.load(vb + j[:, None] * sv_u + d[None, :], mask=dmask, other=0.0)
        s = scores(q, k, alpha, PREC)
        if HAS_BIAS:
            tj, tj_lo, tj_hi = key_times(T_u, u0, j, L)
            p_lo, p_hi, t_lo, t_hi = ranges(
                pr_lo, pr_hi, n0, n0 + BN - 1, tr_lo, tr_hi, tj_lo, tj_hi
            )
            s = add_bias(s, pr, j, tr, tj, p_lo, p_hi, t_lo, t_hi, POS, TIME, PTHR, TTHR)
        a = s * sigmoid(s, FAST)
        acc += tl.dot(a.to(v.dtype), v, input_precision=PREC)
    # The diagonal and the history's end: causal and length masks.
    for n0 in range(full_end, kend, BN):
        j = n0 + tl.arange(0, BN)
        kmask = (j < L)[:, None] & dmask
        k = tl.load(kb + j[:, None] * sk_u + d[None, :], mask=kmask, other=0.0)
        v = tl.load(vb + j[:, None] * sv_u + d[None, :], mask=kmask, other=0.0)
        s = scores(q, k, alpha, PREC)
        if HAS_BIAS:
            tj, tj_lo, tj_hi = key_times(T_u, u0, j, L)
            p_lo, p_hi, t_lo, t_hi = ranges(
                pr_lo, pr_hi, n0, n0 + BN - 1, tr_lo, tr_hi, tj_lo, tj_hi
            )
            s = add_bias(s, pr, j, tr, tj, p_lo, p_hi, t_lo, t_hi, POS, TIME, PTHR, TTHR)
        a = s * sigmoid(s, FAST)
        a = tl.where((j[None, :] <= r[:, None]) | (r[:, None] >= L), a, 0.0)
        acc += tl.dot(a.to(v.dtype), v, input_precision=PREC)
    acc = acc * (1.0 / (L + 1).to(tl.float32))
    op = rows(O_u, so_u, so_uh, O_c, so_c, so_ch, h, r, L, u0, c0, d)
    tl.store(op, acc.to(O_c.dtype.element_ty), mask=live)
