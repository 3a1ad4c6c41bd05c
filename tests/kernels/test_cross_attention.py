"""The Triton cross-attention against its torch twin: forward and every gradient.

On a CPU machine the kernels run in Triton's interpreter (fp32, small shapes,
a plan with small chunks so that histories of a few hundred keys are split
over several programs); on CUDA the same tests run compiled, and the `gpu`
ones add bf16, every head dim and h200-21k's lengths.

The tolerance is derived per element (`bound`): the twin runs in float64 on
the same inputs, so the difference is the kernel's own rounding, which is
relative to ``S``, the sum of the absolute values of the terms that make each
element (``A|V|`` for the output, with ``A`` the attention weights; ``Aᵀ|dO|``
for dV; ``|dS||K|`` and ``|dS|ᵀ|Q|`` for dQ and dK, scaled, plus the part due
to ``delta = rowsum(dO * O)``), computed here in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from freescale.kernels.attention.cross import cross_attention_reference, cross_plan
from freescale.testing.tolerance import assert_within, reduction_tol

SMALL = dict(block_n=16, min_chunk=32, max_splits=4)  # interpreter-sized chunks


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()])


def _case(lengths, cands, heads, dim, device, dtype, seed=0, pad_q=0, pad_k=0):
    """q and k/v (two views of one tensor, as the model's qkv), offsets; ``pad_*``
    rows after the last sample (a graph's padding) hold garbage."""
    g = torch.Generator().manual_seed(seed)
    q_off, k_off = _offsets(cands), _offsets(lengths)
    q = torch.randn(int(q_off[-1]) + pad_q, heads, dim, generator=g)
    kv = torch.randn(int(k_off[-1]) + pad_k, 2, heads, dim, generator=g)
    if pad_q:
        q[-pad_q:] = float("nan")
    if pad_k:
        kv[-pad_k:] = float("nan")
    q, kv = q.to(device, dtype), kv.to(device, dtype)
    return q, kv[:, 0], kv[:, 1], q_off.to(device), k_off.to(device)


def _run(q, k, v, q_off, k_off, grad, plan_args):
    from freescale.kernels.attention.triton_cross import cross_attention_triton

    inputs = [t.detach().requires_grad_() for t in (q, k, v)]
    plan = cross_plan(q_off, k_off, **plan_args)
    out = cross_attention_triton(*inputs, plan)
    return [out, *torch.autograd.grad(out, inputs, grad)]


def _magnitudes(q, k, v, grad, q_off, k_off):
    """Per element ``S`` of out, dq, dk, dv (float64), and the largest score ``S``."""
    q, k, v, grad = (t.detach().double() for t in (q, k, v, grad))
    scale = 1.0 / math.sqrt(q.shape[-1])
    mags = [torch.zeros_like(q), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
    score = 0.0
    qb, kb = q_off.tolist(), k_off.tolist()
    for i in range(len(qb) - 1):
        q0, q1, k0, k1 = qb[i], qb[i + 1], kb[i], kb[i + 1]
        if q1 == q0 or k1 == k0:
            continue
        qi, ki, vi, gi = (t.transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1], grad[q0:q1]))
        a = torch.softmax(qi @ ki.transpose(1, 2) * scale, dim=-1)  # [H, N, L]
        o = a @ vi
        dp = gi @ vi.transpose(1, 2)
        delta = (gi * o).sum(-1, keepdim=True)
        ds = (a * (dp - delta)).abs()
        spread = a * (gi * o).abs().sum(-1, keepdim=True)  # delta's rounding, through A
        mags[0][q0:q1] = (a @ vi.abs()).transpose(0, 1)
        mags[1][q0:q1] = (scale * (ds + spread) @ ki.abs()).transpose(0, 1)
        mags[2][k0:k1] = (scale * (ds + spread).transpose(1, 2) @ qi.abs()).transpose(0, 1)
        mags[3][k0:k1] = (a.transpose(1, 2) @ gi.abs()).transpose(0, 1)
        score = max(score, float((qi.abs() @ ki.abs().transpose(1, 2)).max()) * scale)
    return mags, score


def bound(dtype: torch.dtype, terms: int, dim: int, score: float) -> tuple[float, float]:
    """(factor of ``S``, rtol) for the kernel against a float64 twin.

    fp32 sums over up to ``terms`` terms, three chained (the scores' max and
    normalizer, the weighted sum; in backward lse, dS, the products); the
    scores' own fp32 rounding (a dot over ``dim``) moves every weight by up to
    twice that, relative; bf16/fp16 inputs: the weights P and dS rounded to the
    input dtype before their products (at most half an ulp of each term: one
    rounding of ``S``) and the result stored in it (``output``)."""
    factor = reduction_tol(torch.float32, terms, 1.0, depth=3)["atol"]
    factor += 2 * reduction_tol(torch.float32, dim, score)["atol"]
    if dtype == torch.float32:
        return factor, 0.0
    factor += reduction_tol(dtype, 1, 1.0)["atol"]
    return factor, reduction_tol(torch.float32, 1, 1.0, output=dtype)["rtol"]


def check_case(lengths, cands, heads, dim, device, dtype=torch.float32, plan_args=None,
               seed=0, pad_q=0, pad_k=0):  # fmt: skip
    plan_args = SMALL if plan_args is None else plan_args
    q, k, v, q_off, k_off = _case(lengths, cands, heads, dim, device, dtype, seed, pad_q, pad_k)
    grad = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(device, dtype)
    got = _run(q, k, v, q_off, k_off, grad, plan_args)
    n_q, n_k = int(q_off[-1]), int(k_off[-1])
    real = [slice(0, n_q), slice(0, n_q), slice(0, n_k), slice(0, n_k)]
    for t, rows in zip(got, real, strict=True):  # padding rows: exactly 0
        assert torch.equal(t[rows.stop :], torch.zeros_like(t[rows.stop :]))
    inputs = [t[:n].detach().double().requires_grad_() for t, n in ((q, n_q), (k, n_k), (v, n_k))]
    ref = cross_attention_reference(*inputs, q_off, k_off)
    if ref.requires_grad:
        want = [ref, *torch.autograd.grad(ref, inputs, grad[:n_q].double())]
    else:  # no query sees a key: the twin's output is a constant 0
        want = [ref, *(torch.zeros_like(t) for t in inputs)]
    mags, score = _magnitudes(q[:n_q], k[:n_k], v[:n_k], grad[:n_q], q_off, k_off)
    factor, rtol = bound(dtype, max(max(lengths, default=1), max(cands, default=1), dim), dim,
                         score)  # fmt: skip
    for name, a, b, s, rows in zip(("out", "dq", "dk", "dv"), got, want, mags, real, strict=True):
        a = a[rows].detach().double().cpu()
        assert_within(a, b.detach().cpu(), (factor * s).cpu(), rtol, what=f"cross attention {name}")
    return got


# Every case: empty histories, zero candidates, lengths off the tile and chunk
# sizes, one candidate, more candidates than a query tile (16), a history
# split over the most chunks (4 of 64 keys at 200 keys with SMALL).
CASES = {
    "mixed": ([0, 1, 31, 200, 7, 64, 65, 0], [3, 2, 1, 20, 4, 0, 5, 0]),
    "no-history": ([0, 0, 0], [2, 1, 3]),
    "one-candidate-long": ([500], [1]),
    "no-candidates": ([40, 3, 17], [0, 0, 0]),
    "many-candidates": ([33, 0, 129], [17, 40, 33]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_twin(triton_device, name):
    lengths, cands = CASES[name]
    check_case(lengths, cands, heads=2, dim=16, device=triton_device)


def test_padding_rows_get_zeros_and_default_plan(triton_device):
    """Rows after the last sample (CUDA graphs' padding) are neither read nor
    left unwritten; with the default chunks (one per sample at these sizes)."""
    lengths, cands = CASES["mixed"]
    check_case(lengths, cands, 1, 32, triton_device, plan_args={}, pad_q=3, pad_k=70)


def test_bitwise_reproducible(triton_device):
    lengths, cands = CASES["mixed"]
    q, k, v, q_off, k_off = _case(lengths, cands, 2, 16, triton_device, torch.float32)
    grad = torch.randn_like(q)
    first = _run(q, k, v, q_off, k_off, grad, SMALL)
    again = _run(q, k, v, q_off, k_off, grad, SMALL)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))


def test_plan_bounds_hold():
    """Chunks are never empty, at most ``max_splits`` per sample and within the
    grid's and the partial buffers' host bounds (any lengths)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        b = int(torch.randint(1, 40, (1,), generator=g))
        lengths = torch.randint(0, 3000, (b,), generator=g) * (torch.rand(b, generator=g) > 0.2)
        cands = torch.randint(0, 9, (b,), generator=g)
        k_off, q_off = _offsets(lengths.tolist()), _offsets(cands.tolist())
        for args in (SMALL, {}):
            plan = cross_plan(q_off, k_off, int(lengths.max()), **args)
            chunks = plan.chunk_offsets.diff().long()
            span = plan.span.long()
            assert (chunks <= plan.splits_bound).all()
            assert ((chunks - 1) * span < lengths).all() and (chunks * span >= lengths).all()
            assert int(plan.chunk_offsets[-1]) <= plan.max_chunks(int(k_off[-1]))
            assert int(plan.part_offsets[-1]) <= plan.max_partials(int(q_off[-1]))


def test_bad_inputs_raise(triton_device):
    from freescale.kernels.attention.triton_cross import cross_attention_triton

    q, k, v, q_off, k_off = _case([4], [2], 1, 24, triton_device, torch.float32)
    with pytest.raises(ValueError, match="head dim"):
        cross_attention_triton(q, k, v, cross_plan(q_off, k_off))
    with pytest.raises(ValueError, match="multiple"):
        cross_plan(q_off, k_off, block_n=16, min_chunk=40)


# ---- full size, compiled (CUDA) ---------------------------------------------------
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _h200_lengths(batch: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """h200-21k's lengths (lognormal, median 4500, sigma 0.55, cap 17000) and 1..8
    candidates, with an empty history and a sample without candidates."""
    import numpy as np

    from freescale.data.distributions import LengthDistribution

    rng = np.random.default_rng(seed)
    lengths = LengthDistribution().sample(rng, batch).tolist()
    cands = rng.integers(1, 9, batch).tolist()
    lengths[0], cands[-1] = 0, 0
    return lengths, cands


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [32, 64, 128])
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_small_cases(dtype, dim, name):
    lengths, cands = CASES[name]
    for plan_args in (SMALL, {}):
        check_case(lengths, cands, 2, dim, "cuda", dtype, plan_args, pad_q=2, pad_k=5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_h200_lengths(dtype):
    lengths, cands = _h200_lengths(32)
    lengths[1] = 17_000  # the longest: split over MAX_SPLITS programs
    check_case(lengths, cands, 4, 64, "cuda", dtype, plan_args={})
