"""Attention metadata computed once per forward changes no number.

``pinned_*`` are frozen copies of the model's forward and attention as they
were before the per-forward layout (commit 181c081), where every layer
recomputed its offsets, int32 copies, maxima and empty-sample masks. The
current model must give bit-identical logits and gradients, on the CPU
reference path and on the varlen path (run on CPU through a stand-in for
``varlen_attn``, since flash attention needs CUDA).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from freescale.jagged.batch import UIH_ACTIONS, UIH_IDS, SampleBatch
from freescale.jagged.ops import segment_ids
from freescale.models import ModelConfig, SequenceModel, bce_loss
from freescale.testing.batches import random_batch
from freescale.testing.tolerance import assert_reordered_close

# Chained reductions of one block's forward (its backward has as many):
# LayerNorm, qkv, scores, softmax, values, proj, LayerNorm, the two MLP matmuls.
BLOCK_DEPTH = 9


# ---- pinned pre-change computation -------------------------------------------------
def pinned_reference(q, k, v, q_offsets, k_offsets, causal):
    out = torch.zeros_like(q)
    qb, kb = q_offsets.tolist(), k_offsets.tolist()
    for i in range(len(qb) - 1):
        q0, q1, k0, k1 = qb[i], qb[i + 1], kb[i], kb[i + 1]
        if q1 == q0 or k1 == k0:
            continue
        qi, ki, vi = (t.transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        out[q0:q1] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal).transpose(0, 1)
    return out


def pinned_varlen(q, k, v, q_offsets, k_offsets, causal, max_q, max_k):
    from torch.nn.attention.varlen import varlen_attn

    dtype = q.dtype
    half = torch.bfloat16 if dtype == torch.float32 else dtype
    cu_q, cu_k = q_offsets.to(torch.int32), k_offsets.to(torch.int32)
    out = varlen_attn(
        q.to(half),
        k.to(half),
        v.to(half),
        cu_q,
        cu_k,
        max(max_q, 1),
        max(max_k, 1),
        window_size=(-1, 0) if causal else (-1, -1),
    )
    out = out.to(dtype)
    k_len = k_offsets[1:] - k_offsets[:-1]
    q_len = q_offsets[1:] - q_offsets[:-1]
    empty = torch.repeat_interleave(k_len == 0, q_len, output_size=q.shape[0])
    return out.masked_fill(empty[:, None, None], 0.0)


def pinned_attention(q, k, v, q_offsets, k_offsets, causal, max_q, max_k, impl):
    if impl == "auto":
        impl = "varlen" if q.is_cuda else "reference"
    if impl == "reference":
        return pinned_reference(q, k, v, q_offsets, k_offsets, causal)
    if max_q is None or max_k is None:
        max_q = int((q_offsets[1:] - q_offsets[:-1]).max()) if q_offsets.numel() > 1 else 0
        max_k = int((k_offsets[1:] - k_offsets[:-1]).max()) if k_offsets.numel() > 1 else 0
    return pinned_varlen(q, k, v, q_offsets, k_offsets, causal, max_q, max_k)


def pinned_block(block, uih, cand, uih_off, cand_off, max_uih, max_cand):
    qu, ku, vu = block.qkv(block.norm1(uih)).chunk(3, dim=-1)
    qc = block.qkv(block.norm1(cand)).chunk(3, dim=-1)[0]
    qu, ku, vu, qc = (block._heads(t) for t in (qu, ku, vu, qc))
    att = block.impl
    self_att = pinned_attention(qu, ku, vu, uih_off, uih_off, True, max_uih, max_uih, att)
    cross = pinned_attention(qc, ku, vu, cand_off, uih_off, False, max_cand, max_uih, att)
    uih = uih + block.proj(self_att.flatten(1))
    cand = cand + block.proj(cross.flatten(1))
    return uih + block.mlp(block.norm2(uih)), cand + block.mlp(block.norm2(cand))


def pinned_forward(m: SequenceModel, batch: SampleBatch, max_uih=None, max_candidates=None):
    n_u, n_c = batch.uih[UIH_IDS].numel(), batch.num_candidates_total
    rows = m.item_emb(m.embedding_inputs(batch)["item_emb"])
    uih = rows[:n_u] + m.action_emb(batch.uih[UIH_ACTIONS])
    cand = rows[n_u : n_u + n_c] + m._pool_content(rows[n_u + n_c :], batch)
    if m.dense_proj is not None and batch.dense is not None:
        per_cand = segment_ids(batch.candidates.offsets, n_c)
        cand = cand + m.dense_proj(batch.dense)[per_cand]
    for block in m.blocks:
        uih, cand = pinned_block(
            block, uih, cand, batch.uih.offsets, batch.candidates.offsets, max_uih, max_candidates
        )
    return m.head(cand).squeeze(-1)


# ---- a CPU stand-in for flash varlen attention -------------------------------------
def fake_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, window_size=(-1, -1)):
    """Per segment SDPA, reading the int32 boundaries the way flash attention does."""
    assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
    assert max_q >= 1 and max_k >= 1
    assert max_q >= max((cu_q[1:] - cu_q[:-1]).tolist(), default=0)
    assert max_k >= max((cu_k[1:] - cu_k[:-1]).tolist(), default=0)
    out = torch.full_like(q, float("nan"))  # rows of key-less samples: garbage, masked later
    causal = window_size == (-1, 0)
    for i in range(cu_q.numel() - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        if q1 == q0 or k1 == k0:
            continue
        qi, ki, vi = (t.transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        att = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal)
        out[q0:q1] = att.transpose(0, 1)
    return out


# ---- the comparisons ---------------------------------------------------------------
def _run(m: SequenceModel, forward, batch, **maxima) -> tuple[Tensor, Tensor, list[Tensor]]:
    m.zero_grad(set_to_none=True)
    logits = forward(batch, **maxima)
    loss = bce_loss(logits, batch.labels, max(1, batch.labels.numel()))
    loss.backward()
    grads = [None if p.grad is None else p.grad.clone() for p in m.parameters()]
    return logits.detach(), loss.detach(), grads


def _assert_bit_equal(new, old) -> None:
    (la, sa, ga), (lb, sb, gb) = new, old
    assert torch.equal(la, lb) and torch.equal(sa, sb)
    for a, b in zip(ga, gb, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert any(a is not None for a in ga)


BATCHES = [
    dict(seed=1, batch_size=9, max_uih=7, max_candidates=3, max_content=2),
    dict(seed=2, batch_size=1, max_uih=5, max_candidates=2),  # one sample
    dict(seed=3, batch_size=6, max_uih=0, max_candidates=3),  # every UIH empty
    dict(seed=4, batch_size=16, max_uih=12, max_candidates=4, dense_dim=None),
]


def _batch(spec: dict) -> SampleBatch:
    spec = dict(spec)
    return random_batch(num_items=100, **spec)


@pytest.mark.parametrize("spec", BATCHES)
@pytest.mark.parametrize("attention", ["auto", "reference"])
def test_reference_path_bit_identical(spec, attention):
    cfg = ModelConfig(num_items=100, dim=16, heads=2, layers=3, dense_dim=2, attention=attention)
    torch.manual_seed(0)
    m = SequenceModel(cfg)
    batch = _batch(spec)
    _assert_bit_equal(_run(m, m, batch), _run(m, lambda b: pinned_forward(m, b), batch))


@pytest.mark.parametrize("spec", BATCHES)
@pytest.mark.parametrize("given_maxima", [False, True])
def test_varlen_path_bit_identical(monkeypatch, spec, given_maxima):
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", fake_varlen_attn)
    cfg = ModelConfig(num_items=100, dim=16, heads=2, layers=3, dense_dim=2, attention="varlen")
    torch.manual_seed(0)
    m = SequenceModel(cfg)
    batch = _batch(spec)
    maxima = {}
    if given_maxima:
        uih, cand = batch.uih_lengths(), batch.num_candidates()
        maxima = {"max_uih": int(uih.max()), "max_candidates": int(cand.max())}
    told = batch.with_max_lengths(*maxima.values()) if maxima else batch
    new = _run(m, lambda b, **kw: m(told), batch, **maxima)
    old = _run(m, lambda b, **kw: pinned_forward(m, b, **kw), batch, **maxima)
    _assert_bit_equal(new, old)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", BATCHES)
def test_flash_path_unchanged_on_gpu(spec, monkeypatch):
    """The real flash kernels: logits and loss bit-identical; gradients close
    (flash backward may accumulate with atomics, so two equal runs can differ).

    Deterministic algorithms as in training with ``deterministic=true``: without
    them the content pooling's CUDA ``index_add`` (atomics, in both forwards)
    made two runs of the *same* forward differ by 1 ulp (measured on H200)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _check_flash(spec)
    finally:
        torch.use_deterministic_algorithms(previous)


def _check_flash(spec):
    # varlen, not auto: auto may run the self-attention on cuDNN (cudnn_sdpa)
    cfg = ModelConfig(num_items=100, dim=64, heads=2, layers=3, dense_dim=2, attention="varlen")
    torch.manual_seed(0)
    m = SequenceModel(cfg).cuda()
    batch = _batch(spec).to("cuda")
    new = _run(m, m, batch)
    old = _run(m, lambda b: pinned_forward(m, b), batch)
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    # The flash backward's atomics reorder its sums; its bf16 gradients then
    # flow back through the blocks, and the weight gradients sum over tokens.
    tokens = batch.uih[UIH_IDS].numel() + batch.num_candidates_total
    tol = dict(terms=max(2 * cfg.dim, tokens), depth=2 * BLOCK_DEPTH * cfg.layers)
    for a, b in zip(new[2], old[2], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert_reordered_close(a, b, **tol, dtype=torch.bfloat16)
