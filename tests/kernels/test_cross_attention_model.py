"""The sequence model with its cross-attention on the Triton kernel equals the
reference model (the kernel interpreted on a CPU machine, compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from freescale.jagged.batch import UIH_IDS
from freescale.models import ModelConfig, SequenceModel, bce_loss
from freescale.testing.batches import random_batch
from freescale.testing.tolerance import assert_reordered_close

# Chained reductions of one block's forward (its backward has as many):
# LayerNorm, qkv, scores, softmax, values, proj, LayerNorm, the two MLP matmuls.
BLOCK_DEPTH = 9


def _grads(m: SequenceModel, batch) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    m.zero_grad(set_to_none=True)
    logits = m(batch)
    bce_loss(logits, batch.labels, max(1, batch.labels.numel())).backward()
    return logits.detach(), [None if p.grad is None else p.grad.clone() for p in m.parameters()]


@pytest.mark.parametrize("seed", [1, 3])
def test_model_with_triton_cross_attention_matches_reference(triton_device, seed):
    cfg = ModelConfig(num_items=100, dim=32, heads=2, layers=2, dense_dim=2)
    torch.manual_seed(0)
    ref_model = SequenceModel(ModelConfig(**{**cfg.__dict__, "attention": "reference"}))
    # fp32 throughout (the reference self-attention runs on CUDA too): only the
    # cross-attention's sums are reordered.
    triton_cfg = {**cfg.__dict__, "attention": "reference", "cross_attention": "triton"}
    m = SequenceModel(ModelConfig(**triton_cfg))
    m.load_state_dict(ref_model.state_dict())
    batch = random_batch(seed=seed, batch_size=12, max_uih=40, max_candidates=5, num_items=100)
    want_logits, want = _grads(ref_model, batch)
    m = m.to(triton_device)
    got_logits, got = _grads(m, batch.to(triton_device))
    tokens = batch.uih[UIH_IDS].numel() + batch.num_candidates_total
    tol = dict(terms=max(2 * cfg.dim, tokens), depth=2 * BLOCK_DEPTH * cfg.layers)
    assert_reordered_close(got_logits.cpu(), want_logits, **tol)
    for a, b in zip(got, want, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert_reordered_close(a.cpu(), b, **tol)
