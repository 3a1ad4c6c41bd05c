"""The backward Triton kernels of the fused jagged HSTU attention (the math and
the building blocks: `triton_hstu_tiles`): dq over query blocks, then dk/dv
and the bias-table gradients over key blocks. No atomics: every output
element is written by one program, the bias gradients as per-program
partials that the launcher (`hstu`) sums in a fixed order, so the backward is
deterministic."""

from __future__ import annotations

import triton
import triton.language as tl

from freescale.kernels.attention.triton_hstu_tiles import (
    P_NB,
    T_NB,
    add_bias,
    bias_grads,
    find,
    key_times,
    qrow_setup,
    query_block,
    ranges,
    rows,
    scores,
    sigmoid,
)


@triton.jit
def _dscore(s, da, FAST: tl.constexpr):
    """(SiLU(s), dL/ds) given dL/dSiLU(s) = da."""
    sig = sigmoid(s, FAST)
    return s * sig, da * sig * (1.0 + s * (1.0 - sig))


@triton.jit
def _q_do(Q_u, sq_u, sq_uh, Q_c, sq_c, sq_ch, DO_u, sdo_u, sdo_uh, DO_c, sdo_c, sdo_ch,
          h, r, L, u0, c0, d, live):  # fmt: skip
    """The query rows ``r`` and their output gradients (in the queries' dtype)."""
    q = tl.load(rows(Q_u, sq_u, sq_uh, Q_c, sq_c, sq_ch, h, r, L, u0, c0, d), mask=live, other=0.0)
    do = tl.load(rows(DO_u, sdo_u, sdo_uh, DO_c, sdo_c, sdo_ch, h, r, L, u0, c0, d), mask=live,
                 other=0.0)  # fmt: skip
    return q, do.to(q.dtype)


@triton.jit(do_not_specialize=["n_samples", "alpha"])
def _dq_kernel(
    Q_u, K_u, V_u, Q_c, DO_u, DO_c, DQ_u, DQ_c, T_u, T_c, UIH_OFF, CAND_OFF, ORDER, BLOCK_START,
    POS, TIME, PTHR, TTHR,
    sq_u, sq_uh, sk_u, sk_uh, sv_u, sv_uh, sq_c, sq_ch, sdo_u, sdo_uh, sdo_c, sdo_ch,
    sdq_u, sdq_uh, sdq_c, sdq_ch,
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
    q, do = _q_do(Q_u, sq_u, sq_uh, Q_c, sq_c, sq_ch, DO_u, sdo_u, sdo_uh, DO_c, sdo_c, sdo_ch,
                  h, r, L, u0, c0, d, live)  # fmt: skip
    pr, tr, tr_lo, tr_hi = qrow_setup(r, L, C, u0, c0, T_u, T_c, HAS_BIAS)
    pr_lo = tl.minimum(r0, L)
    pr_hi = tl.minimum(r0 + BM - 1, L)
    acc = tl.full((BM, D), 0.0, tl.float32)
    kend = tl.minimum(r0 + BM, L)
    full_end = (tl.minimum(r0 + 1, L) // BN) * BN
    kb = K_u + u0 * sk_u + h * sk_uh
    vb = V_u + u0 * sv_u + h * sv_uh
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
        _, ds = _dscore(s, tl.dot(do, tl.trans(v), input_precision=PREC), FAST)
        acc += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
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
        _, ds = _dscore(s, tl.dot(do, tl.trans(v), input_precision=PREC), FAST)
        ds = tl.where((j[None, :] <= r[:, None]) | (r[:, None] >= L), ds, 0.0)
        acc += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    acc = acc * (alpha / (L + 1).to(tl.float32))
    dqp = rows(DQ_u, sdq_u, sdq_uh, DQ_c, sdq_c, sdq_ch, h, r, L, u0, c0, d)
    tl.store(dqp, acc.to(DQ_c.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["n_samples", "alpha"])
def _dkdv_kernel(
    Q_u, K_u, V_u, Q_c, DO_u, DO_c, DK, DV, DPOS, DTIME, T_u, T_c, UIH_OFF, CAND_OFF, ORDER,
    BLOCK_START, POS, TIME, PTHR, TTHR,
    sq_u, sq_uh, sk_u, sk_uh, sv_u, sv_uh, sq_c, sq_ch, sdo_u, sdo_uh, sdo_c, sdo_ch,
    sdk, sdkh, sdv, sdvh,
    n_samples, alpha, DH, H,
    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UIH_OUT: tl.constexpr,
    HAS_BIAS: tl.constexpr, FAST: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    if pid >= tl.load(BLOCK_START + n_samples):
        return
    h = tl.program_id(1)
    b, blk, _count = find(BLOCK_START, ORDER, n_samples, pid)
    u0 = tl.load(UIH_OFF + b)
    L = (tl.load(UIH_OFF + b + 1) - u0).to(tl.int32)
    c0 = tl.load(CAND_OFF + b)
    C = (tl.load(CAND_OFF + b + 1) - c0).to(tl.int32)
    n0 = (blk * BN).to(tl.int32)  # the first (heaviest) key block first
    j = n0 + tl.arange(0, BN)
    d = tl.arange(0, D)
    dmask = (d < DH)[None, :]
    kmask = (j < L)[:, None] & dmask
    k = tl.load(K_u + (u0 + j)[:, None] * sk_u + h * sk_uh + d[None, :], mask=kmask, other=0.0)
    v = tl.load(V_u + (u0 + j)[:, None] * sv_u + h * sv_uh + d[None, :], mask=kmask, other=0.0)
    if HAS_BIAS:
        tj, tj_lo, tj_hi = key_times(T_u, u0, j, L)
    else:
        tj = j.to(tl.int64)
    dk = tl.full((BN, D), 0.0, tl.float32)
    dv = tl.full((BN, D), 0.0, tl.float32)
    dpos = tl.full((P_NB,), 0.0, tl.float32)
    dtime = tl.full((T_NB,), 0.0, tl.float32)
    if UIH_OUT:
        start = (n0 // BM) * BM
        diag_end = tl.minimum(start + ((n0 + BN - start + BM - 1) // BM) * BM, L + C)
    else:
        start = L
        diag_end = L
    rend = L + C
    # Row blocks across the diagonal: the causal mask.
    for r0 in range(start, diag_end, BM):
        r = r0 + tl.arange(0, BM)
        live = (r < rend)[:, None] & dmask
        q, do = _q_do(Q_u, sq_u, sq_uh, Q_c, sq_c, sq_ch, DO_u, sdo_u, sdo_uh, DO_c, sdo_c,
                      sdo_ch, h, r, L, u0, c0, d, live)  # fmt: skip
        pr, tr, tr_lo, tr_hi = qrow_setup(r, L, C, u0, c0, T_u, T_c, HAS_BIAS)
        s = scores(q, k, alpha, PREC)
        if HAS_BIAS:
            p_lo, p_hi, t_lo, t_hi = ranges(tl.minimum(r0, L), tl.minimum(r0 + BM - 1, L), n0,
                                             n0 + BN - 1, tr_lo, tr_hi, tj_lo, tj_hi)  # fmt: skip
            s = add_bias(s, pr, j, tr, tj, p_lo, p_hi, t_lo, t_hi, POS, TIME, PTHR, TTHR)
        a, ds = _dscore(s, tl.dot(do, tl.trans(v), input_precision=PREC), FAST)
        seen = (j[None, :] <= r[:, None]) | (r[:, None] >= L)
        a = tl.where(seen, a, 0.0)
        ds = tl.where(seen, ds, 0.0)
        dv += tl.dot(tl.trans(a.to(do.dtype)), do, input_precision=PREC)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
        if HAS_BIAS:
            dpos, dtime = bias_grads(
                dpos, dtime, ds, pr, j, tr, tj, p_lo, p_hi, t_lo, t_hi, PTHR, TTHR
            )
    # Rows past every key of the block: no mask (missing rows load as zeros).
    for r0 in range(diag_end, rend, BM):
        r = r0 + tl.arange(0, BM)
        live = (r < rend)[:, None] & dmask
        q, do = _q_do(Q_u, sq_u, sq_uh, Q_c, sq_c, sq_ch, DO_u, sdo_u, sdo_uh, DO_c, sdo_c,
                      sdo_ch, h, r, L, u0, c0, d, live)  # fmt: skip
        pr, tr, tr_lo, tr_hi = qrow_setup(r, L, C, u0, c0, T_u, T_c, HAS_BIAS)
        s = scores(q, k, alpha, PREC)
        if HAS_BIAS:
            p_lo, p_hi, t_lo, t_hi = ranges(tl.minimum(r0, L), tl.minimum(r0 + BM - 1, L), n0,
                                             n0 + BN - 1, tr_lo, tr_hi, tj_lo, tj_hi)  # fmt: skip
            s = add_bias(s, pr, j, tr, tj, p_lo, p_hi, t_lo, t_hi, POS, TIME, PTHR, TTHR)
        a, ds = _dscore(s, tl.dot(do, tl.trans(v), input_precision=PREC), FAST)
        dv += tl.dot(tl.trans(a.to(do.dtype)), do, input_precision=PREC)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PREC)
        if HAS_BIAS:
            dpos, dtime = bias_grads(
                dpos, dtime, ds, pr, j, tr, tj, p_lo, p_hi, t_lo, t_hi, PTHR, TTHR
            )
    inv_n = 1.0 / (L + 1).to(tl.float32)
    out = (j < L)[:, None] & dmask
    dkp = DK + (u0 + j)[:, None] * sdk + h * sdkh + d[None, :]
    dvp = DV + (u0 + j)[:, None] * sdv + h * sdvh + d[None, :]
    tl.store(dkp, (dk * (alpha * inv_n)).to(DK.dtype.element_ty), mask=out)
    tl.store(dvp, (dv * inv_n).to(DV.dtype.element_ty), mask=out)
    if HAS_BIAS:
        row = pid * H + h
        tl.store(DPOS + row * P_NB + tl.arange(0, P_NB), dpos * inv_n)
        tl.store(DTIME + row * T_NB + tl.arange(0, T_NB), dtime * inv_n)
