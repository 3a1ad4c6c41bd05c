"""Triton candidate -> history cross-attention, split over keys (flash-decoding style).

Reference: `freescale.kernels.attention.cross.cross_attention_reference`
(each candidate attends to its sample's whole history, softmax, scale
``1/sqrt(D)``; no keys: output 0). A sample has a handful of queries and up to
~21k keys, so the work is cut along the keys, never padded to the longest
history, and no ``[queries, keys]`` matrix is stored (`cross_plan` gives the
chunks):

Forward
1. ``split``: program (chunk, head) runs its sample's queries (in tiles of
   ``BLOCK_M``) over the chunk's keys (tiles of ``BLOCK_N``) with the online
   softmax, and writes one *partial* per query: the chunk's normalized output
   and its log-sum-exp (base 2). A 17k-key history is ``MAX_SPLITS``
   programs, so a long sample is no straggler.
2. ``reduce``: program (query, head) merges its sample's partials in chunk
   order: ``lse = log2 sum_j 2^lse_j``, ``out = sum_j 2^(lse_j - lse) o_j``;
   writes the output and ``lse`` (saved for backward). No keys: 0.

Backward (recompute from the saved ``lse``; ``delta = rowsum(dO * O)`` in torch)
3. ``split``: program (chunk, head) loops over its key tiles, and for each over
   the sample's query tiles: ``P = 2^(S - lse)``, ``dV += Pᵀ dO``,
   ``dS = P (dO Vᵀ - delta)``, ``dK += dSᵀ Q``; each key belongs to exactly one
   program, so dK/dV are stored once, no atomics. The query gradient of the
   chunk, ``dS K``, is added up over the chunk's key tiles in a partial per
   (query, chunk) that only this program touches (a barrier orders its
   read-modify-writes). Programs past the last chunk zero the key rows after
   the last sample (padding), so every output row is written.
4. ``reduce``: program (query, head) sums its partials in chunk order.

Every sum runs in a fixed order set by the layout alone: bitwise
reproducible run to run. Inputs may be strided views (the three heads-views of
one qkv projection: last dim contiguous); outputs are new contiguous tensors.
bf16/fp16 inputs multiply on tensor cores (P and dS rounded to the input
dtype, as flash attention does), fp32 ones in full fp32 (``ieee`` dots);
accumulation is fp32. The grid is sized from tensor sizes (``cdiv(keys,
MIN_CHUNK) + B`` chunk programs per head, one per query for the reductions):
no host read, surplus programs exit at once.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from freescale.kernels.attention.cross import (
    HEAD_DIMS,
    CrossPlan,
    cross_attention_reference,
    cross_plan,
)
from freescale.kernels.triton_common import (
    bench_ms,
    check_launchable,
    row_max,
    row_sum,
    search_steps,
)

BLOCK_M = 16  # queries per tile (tl.dot's minimum)
LOG2E = 1.4426950408889634


# ---- kernels --------------------------------------------------------------
@triton.jit
def _sample_of(bounds, x, n, n_steps):
    """Largest ``i < n`` with ``bounds[i] <= x`` (sorted ``bounds``, ``bounds[0] <= x``):
    the sample whose range holds ``x``, skipping empty ones."""
    lo = x * 0
    hi = lo + n
    for _ in range(n_steps):
        mid = (lo + hi) >> 1
        right = tl.load(bounds + mid) <= x
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit(do_not_specialize=["n_samples", "n_steps"])
def _cross_attn_fwd_split(
    q, k, v, sq_row, sq_head, sk_row, sk_head, sv_row, sv_head,
    q_offsets, k_offsets, chunk_offsets, span, part_offsets, part_o, part_lse,
    n_samples, n_steps, qk_scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    if g < tl.load(chunk_offsets + n_samples):
        i = _sample_of(chunk_offsets, g, n_samples, n_steps)
        first = tl.load(chunk_offsets + i)
        j = g - first
        splits = tl.load(chunk_offsets + i + 1) - first
        k0 = tl.load(k_offsets + i)
        n_keys = tl.load(k_offsets + i + 1) - k0
        q0 = tl.load(q_offsets + i)
        n_q = tl.load(q_offsets + i + 1) - q0
        width = tl.load(span + i).to(tl.int64)
        lo = j.to(tl.int64) * width
        hi = tl.minimum(lo + width, n_keys)
        p0 = tl.load(part_offsets + i)
        for m0 in range(0, n_q, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            rmask = rows < n_q
            qp = q + (q0 + rows)[:, None] * sq_row + h * sq_head + d[None, :]
            qb = tl.load(qp, mask=rmask[:, None], other=0.0)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.full([BLOCK_M], 0.0, tl.float32)
            acc = tl.full([BLOCK_M, D], 0.0, tl.float32)
            for n0 in range(lo, hi, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                cmask = cols < hi
                kp = k + (k0 + cols)[None, :] * sk_row + h * sk_head + d[:, None]
                kt = tl.load(kp, mask=cmask[None, :], other=0.0)  # [D, BLOCK_N]
                s = tl.dot(qb, kt, input_precision=PRECISION) * qk_scale
                s = tl.where(cmask[None, :], s, float("-inf"))
                m_new = tl.maximum(m_i, row_max(s))
                p = tl.exp2(s - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + row_sum(p)
                vp = v + (k0 + cols)[:, None] * sv_row + h * sv_head + d[None, :]
                vb = tl.load(vp, mask=cmask[:, None], other=0.0)
                pv = tl.dot(p.to(vb.dtype), vb, input_precision=PRECISION)
                acc = acc * alpha[:, None] + pv
                m_i = m_new
            part = p0 + rows.to(tl.int64) * splits + j
            out = part_o + (part * H + h)[:, None] * D + d[None, :]
            tl.store(out, acc / l_i[:, None], mask=rmask[:, None])
            tl.store(part_lse + part * H + h, m_i + tl.log2(l_i), mask=rmask)


@triton.jit(do_not_specialize=["n_samples", "n_steps"])
def _cross_attn_reduce(
    part_o, part_lse, out, lse, q_offsets, chunk_offsets, part_offsets, n_samples, n_steps,
    H: tl.constexpr, D: tl.constexpr, SOFTMAX: tl.constexpr,
):  # fmt: skip
    """``SOFTMAX``: merge forward partials (output and lse); else sum dq partials."""
    c = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    i = _sample_of(q_offsets, c, n_samples, n_steps)
    q0 = tl.load(q_offsets + i)
    inside = c < tl.load(q_offsets + i + 1)  # rows after the last sample: none
    first = tl.load(chunk_offsets + i)
    splits = tl.where(inside, tl.load(chunk_offsets + i + 1) - first, 0)
    base = tl.load(part_offsets + i) + (c - q0) * splits
    acc = tl.full([D], 0.0, tl.float32)
    if SOFTMAX:
        m = tl.full([1], float("-inf"), tl.float32)
        total = tl.full([1], 0.0, tl.float32)
        for j in range(0, splits):
            x = tl.load(part_lse + (base + j) * H + h + tl.arange(0, 1))
            m_new = tl.maximum(m, x)
            a = tl.exp2(m - m_new)
            b = tl.exp2(x - m_new)
            acc = acc * a + b * tl.load(part_o + ((base + j) * H + h) * D + d)
            total = total * a + b
            m = m_new
        has = total > 0
        safe = tl.where(has, total, 1.0)
        tl.store(out + (c * H + h) * D + d, (acc / safe).to(out.dtype.element_ty))
        tl.store(lse + c * H + h + tl.arange(0, 1), tl.where(has, m + tl.log2(safe), 0.0))
    else:
        for j in range(0, splits):
            acc += tl.load(part_o + ((base + j) * H + h) * D + d)
        tl.store(out + (c * H + h) * D + d, acc.to(out.dtype.element_ty))


@triton.jit(do_not_specialize=["n_samples", "n_steps", "n_rows"])
def _cross_attn_bwd_split(
    q, k, v, do, sq_row, sq_head, sk_row, sk_head, sv_row, sv_head, sdo_row, sdo_head,
    lse, delta, dk, dv, part_dq, q_offsets, k_offsets, chunk_offsets, span, part_offsets,
    n_samples, n_steps, n_rows, qk_scale, sm_scale,
    H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_CHUNK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D)
    n_chunks = tl.load(chunk_offsets + n_samples)
    if g < n_chunks:
        i = _sample_of(chunk_offsets, g, n_samples, n_steps)
        first = tl.load(chunk_offsets + i)
        j = g - first
        splits = tl.load(chunk_offsets + i + 1) - first
        k0 = tl.load(k_offsets + i)
        n_keys = tl.load(k_offsets + i + 1) - k0
        q0 = tl.load(q_offsets + i)
        n_q = tl.load(q_offsets + i + 1) - q0
        width = tl.load(span + i).to(tl.int64)
        lo = j.to(tl.int64) * width
        hi = tl.minimum(lo + width, n_keys)
        p0 = tl.load(part_offsets + i)
        for n0 in range(lo, hi, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            cmask = cols < hi
            key_rows = k0 + cols
            kb = tl.load(k + key_rows[:, None] * sk_row + h * sk_head + d[None, :],
                         mask=cmask[:, None], other=0.0)  # fmt: skip
            vb = tl.load(v + key_rows[:, None] * sv_row + h * sv_head + d[None, :],
                         mask=cmask[:, None], other=0.0)  # fmt: skip
            dk_acc = tl.full([BLOCK_N, D], 0.0, tl.float32)
            dv_acc = tl.full([BLOCK_N, D], 0.0, tl.float32)
            for m0 in range(0, n_q, BLOCK_M):
                rows = m0 + tl.arange(0, BLOCK_M)
                rmask = rows < n_q
                q_rows = q0 + rows
                qb = tl.load(q + q_rows[:, None] * sq_row + h * sq_head + d[None, :],
                             mask=rmask[:, None], other=0.0)  # fmt: skip
                dob = tl.load(do + q_rows[:, None] * sdo_row + h * sdo_head + d[None, :],
                              mask=rmask[:, None], other=0.0)  # fmt: skip
                lse_b = tl.load(lse + q_rows * H + h, mask=rmask, other=0.0)
                delta_b = tl.load(delta + q_rows * H + h, mask=rmask, other=0.0)
                s = tl.dot(qb, tl.trans(kb), input_precision=PRECISION) * qk_scale
                p = tl.exp2(s - lse_b[:, None])
                p = tl.where(rmask[:, None] & cmask[None, :], p, 0.0)
                dv_acc += tl.dot(tl.trans(p.to(dob.dtype)), dob, input_precision=PRECISION)
                dp = tl.dot(dob, tl.trans(vb), input_precision=PRECISION)
                ds = p * (dp - delta_b[:, None])
                dk_acc += tl.dot(tl.trans(ds.to(qb.dtype)), qb, input_precision=PRECISION)
                dq = tl.dot(ds.to(kb.dtype), kb, input_precision=PRECISION) * sm_scale
                part = p0 + rows.to(tl.int64) * splits + j
                dqp = part_dq + (part * H + h)[:, None] * D + d[None, :]
                # This program's own partial: written at its first key tile, added to after.
                prev = tl.load(dqp, mask=rmask[:, None] & (n0 > lo), other=0.0)
                tl.store(dqp, prev + dq, mask=rmask[:, None])
                tl.debug_barrier()  # the next tile reads these rows, maybe in other threads
            out_rows = key_rows[:, None] * (H * D) + h * D + d[None, :]
            tl.store(dk + out_rows, (dk_acc * sm_scale).to(dk.dtype.element_ty),
                     mask=cmask[:, None])  # fmt: skip
            tl.store(dv + out_rows, dv_acc.to(dv.dtype.element_ty), mask=cmask[:, None])
    else:
        # Surplus programs: key rows after the last sample (padding) get gradient 0.
        start = tl.load(k_offsets + n_samples) + (g - n_chunks).to(tl.int64) * MIN_CHUNK
        zero = tl.full([BLOCK_N, D], 0.0, tl.float32)
        for r0 in range(0, MIN_CHUNK, BLOCK_N):
            r = start + r0 + tl.arange(0, BLOCK_N)
            at = r[:, None] * (H * D) + h * D + d[None, :]
            tl.store(dk + at, zero.to(dk.dtype.element_ty), mask=(r < n_rows)[:, None])
            tl.store(dv + at, zero.to(dv.dtype.element_ty), mask=(r < n_rows)[:, None])


# ---- launchers ------------------------------------------------------------
def _check(q: Tensor, k: Tensor, v: Tensor, plan: CrossPlan) -> None:
    if q.dim() != 3 or k.shape != v.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"need q [Tq, H, D], k and v [Tk, H, D]; got {q.shape}, {k.shape}, "
                         f"{v.shape}")  # fmt: skip
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS}, got {q.shape[-1]}")
    if not q.dtype == k.dtype == v.dtype or not q.is_floating_point():
        raise ValueError(f"q, k, v must share one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_launchable(_cross_attn_fwd_split, q.device)


def _rows(t: Tensor) -> Tensor:
    """``t`` itself when its last dim is contiguous (a view is read in place)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _precision(t: Tensor) -> str:
    return "ieee" if t.dtype == torch.float32 else "tf32"


def _warps(d: int) -> int:
    return 8 if d >= 128 else 4


def forward(q: Tensor, k: Tensor, v: Tensor, plan: CrossPlan) -> tuple[Tensor, Tensor]:
    """(output [Tq, H, D] in q's dtype, lse [Tq, H] fp32, base 2 of the scaled scores)."""
    _check(q, k, v, plan)
    q, k, v = _rows(q), _rows(k), _rows(v)
    n_q, heads, dim = q.shape
    out = q.new_empty(q.shape)
    lse = torch.empty(n_q, heads, device=q.device, dtype=torch.float32)
    b = plan.batch
    if n_q == 0 or heads == 0:
        return out, lse
    if b == 0:
        return out.zero_(), lse.zero_()
    parts = plan.max_partials(n_q)
    part_o = torch.empty(parts, heads, dim, device=q.device, dtype=torch.float32)
    part_lse = torch.empty(parts, heads, device=q.device, dtype=torch.float32)
    steps = search_steps(b)
    scale = LOG2E / math.sqrt(dim)
    grid = (plan.max_chunks(k.shape[0]), heads)
    _cross_attn_fwd_split[grid](
        q, k, v, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        plan.q_offsets, plan.k_offsets, plan.chunk_offsets, plan.span, plan.part_offsets,
        part_o, part_lse, b, steps, scale, H=heads, D=dim, BLOCK_M=BLOCK_M,
        BLOCK_N=plan.block_n, PRECISION=_precision(q), num_warps=_warps(dim),
    )  # fmt: skip
    _cross_attn_reduce[(n_q, heads)](
        part_o, part_lse, out, lse, plan.q_offsets, plan.chunk_offsets, plan.part_offsets,
        b, steps, H=heads, D=dim, SOFTMAX=True,
    )  # fmt: skip
    return out, lse


def backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad: Tensor, plan: CrossPlan
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), new contiguous tensors in the inputs' dtype; every row written."""
    q, k, v, grad = _rows(q), _rows(k), _rows(v), _rows(grad)
    n_q, heads, dim = q.shape
    dq, dk, dv = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
    b = plan.batch
    if heads == 0 or (n_q == 0 and k.shape[0] == 0):
        return dq, dk, dv
    if b == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    delta = (grad.float() * out.float()).sum(-1)  # [Tq, H]: rowsum(dO * O)
    parts = plan.max_partials(n_q)
    part_dq = torch.empty(parts, heads, dim, device=q.device, dtype=torch.float32)
    steps = search_steps(b)
    sm_scale = 1.0 / math.sqrt(dim)
    grid = (plan.max_chunks(k.shape[0]), heads)
    _cross_attn_bwd_split[grid](
        q, k, v, grad, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), grad.stride(0), grad.stride(1), lse, delta, dk, dv, part_dq,
        plan.q_offsets, plan.k_offsets, plan.chunk_offsets, plan.span, plan.part_offsets,
        b, steps, k.shape[0], sm_scale * LOG2E, sm_scale, H=heads, D=dim, BLOCK_M=BLOCK_M,
        BLOCK_N=plan.block_n, MIN_CHUNK=plan.min_chunk, PRECISION=_precision(q),
        num_warps=_warps(dim),
    )  # fmt: skip
    if n_q:
        _cross_attn_reduce[(n_q, heads)](
            part_dq, part_dq, dq, dq, plan.q_offsets, plan.chunk_offsets, plan.part_offsets,
            b, steps, H=heads, D=dim, SOFTMAX=False,
        )  # fmt: skip
    return dq, dk, dv


class CrossAttention(torch.autograd.Function):
    """``out = cross_attention(q, k, v)`` on `forward`/`backward` above."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: CrossPlan) -> Tensor:  # type: ignore[override]
        out, lse = forward(q, k, v, plan)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = backward(q, k, v, out, lse, grad, ctx.plan)
        return dq, dk, dv, None


def cross_attention_triton(q: Tensor, k: Tensor, v: Tensor, plan: CrossPlan) -> Tensor:
    """The Triton twin of `cross_attention_reference` (differentiable)."""
    return CrossAttention.apply(q, k, v, plan)


# ---- check and timing -----------------------------------------------------
def random_case(
    lengths: list[int], candidates: list[int], heads: int, dim: int, device: str,
    dtype: torch.dtype = torch.float32, seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """q, k, v (k and v: two views of one [Tk, 2, H, D] tensor, as the model's)
    and the offsets of a batch of ``lengths`` keys and ``candidates`` queries."""
    g = torch.Generator().manual_seed(seed)
    k_off = _offsets(torch.tensor(lengths, dtype=torch.int64))
    q_off = _offsets(torch.tensor(candidates, dtype=torch.int64))
    q = torch.randn(int(q_off[-1]), heads, dim, generator=g)
    kv = torch.randn(int(k_off[-1]), 2, heads, dim, generator=g)
    q, kv = q.to(device, dtype), kv.to(device, dtype)
    return q, kv[:, 0], kv[:, 1], q_off.to(device), k_off.to(device)


def _offsets(lengths: Tensor) -> Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def check(device: str = "cuda", lengths: list[int] | None = None) -> None:
    """The kernel against the twin (float64) on one case, forward and gradients."""
    lengths = lengths or [0, 1, 300, 5000, 17000, 64, 65]
    cands = [3, 2, 1, 8, 4, 0, 5]
    q, k, v, q_off, k_off = random_case(lengths, cands, 4, 64, device)
    grad = torch.randn_like(q)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = cross_attention_triton(q, k, v, cross_plan(q_off, k_off))
    got = [out, *torch.autograd.grad(out, (q, k, v), grad)]
    ref_in = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = cross_attention_reference(*ref_in, q_off, k_off)
    want = [ref, *torch.autograd.grad(ref, ref_in, grad.double())]
    # fp32 sums over up to n terms (keys, or queries x keys for dk/dv) whose
    # absolute sum is ~sqrt(n) max|result|, three chained (scores, softmax,
    # products): `freescale.testing.tolerance.reduction_tol`'s bound, inline.
    n = max(max(lengths), 1) * max(cands)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        err = float((a.double() - b).abs().max())
        bound = 4 * torch.finfo(torch.float32).eps * n * 3 * float(b.abs().max())
        assert err <= bound, f"cross attention {name} differs from the twin by {err} > {bound}"


def bench(lengths: list[int], candidates: list[int], heads: int = 4, dim: int = 64) -> float:
    """Milliseconds of forward + backward on CUDA (bf16)."""
    q, k, v, q_off, k_off = random_case(lengths, candidates, heads, dim, "cuda", torch.bfloat16)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    plan = cross_plan(q_off, k_off, max(lengths))
    grad = torch.randn_like(q)

    def step() -> None:
        cross_attention_triton(q, k, v, plan).backward(grad)

    return bench_ms(step)


if __name__ == "__main__":
    check()
    print("ok")
