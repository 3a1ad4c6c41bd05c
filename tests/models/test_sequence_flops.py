"""`SequenceModel.flops` against an independent count: torch's `FlopCounterMode`.

The counter sees every matmul the CPU reference path runs. One convention
differs, by design: the reference computes the causal self-attention as full
L × L products (`scaled_dot_product_attention` with ``is_causal``, masked),
where the count takes the L(L+1)/2 pairs the varlen kernel computes; the
difference, 4·D·L(L−1)/2 per sample and history-updating block, is added back
here. Everything else is equal to the FLOP.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from freescale.jagged import SampleBatch
from freescale.jagged.tensor import JaggedFeatures
from freescale.models import ModelConfig, SequenceModel, bce_loss
from freescale.testing.batches import random_batch

CFG = ModelConfig(num_items=100, num_actions=4, dim=16, heads=2, layers=3, dense_dim=2)


def _model(cfg: ModelConfig = CFG) -> SequenceModel:
    torch.manual_seed(0)
    return SequenceModel(ModelConfig(**{**cfg.__dict__, "attention": "reference"}))


def _masked_half(batch: SampleBatch, cfg: ModelConfig) -> int:
    """FLOPs the reference spends on masked (future) pairs of the causal attention."""
    lengths = batch.uih_lengths()
    return 4 * cfg.dim * int((lengths * (lengths - 1) // 2).sum()) * (cfg.layers - 1)


def _counted(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


@pytest.mark.parametrize(
    ("seed", "batch_size", "layers", "dense_dim"),
    [(1, 9, 3, 2), (2, 0, 3, 2), (3, 1, 2, 0), (4, 6, 1, 2), (5, 12, 2, 0)],
)
def test_forward_matches_a_flop_counter(seed, batch_size, layers, dense_dim):
    """Random jagged batches: zero-length histories, samples without candidates,
    candidates without content, an empty batch; one block (no history update)."""
    cfg = ModelConfig(**{**CFG.__dict__, "layers": layers, "dense_dim": dense_dim})
    batch = random_batch(seed, batch_size, max_uih=7, max_candidates=3, max_content=2,
                         dense_dim=dense_dim or None)  # fmt: skip
    m = _model(cfg)
    counted = _counted(lambda: m(batch))
    assert m.flops(batch) == 3 * (counted - _masked_half(batch, cfg))


def test_backward_costs_twice_the_forward():
    """Forward + backward = 3 × forward, as counted: every matmul's input and
    weight gradients, except ``dense_proj``'s input (the data) gradient."""
    batch = random_batch(7, 8, max_uih=6, max_candidates=3, max_content=2)
    assert batch.num_candidates_total > 0  # an empty loss has no backward at all
    m = _model()
    logits = m(batch)
    counted = _counted(lambda: m(batch))
    both = counted + _counted(lambda: bce_loss(logits, batch.labels, 1).backward())
    data_grad = 2 * CFG.dense_dim * CFG.dim * batch.batch_size
    assert m.flops(batch) == both + data_grad - 3 * _masked_half(batch, CFG)


def test_flops_by_hand():
    """One sample, L = 3, 2 candidates, D = 16, mlp_ratio 2, 2 blocks, no dense."""
    cfg = ModelConfig(num_items=100, num_actions=4, dim=16, heads=2, layers=2)
    uih = JaggedFeatures(
        torch.tensor([0, 3]), {"item_ids": torch.arange(3), "actions": torch.zeros(3).long()}
    )
    cands = JaggedFeatures(torch.tensor([0, 2]), {"item_ids": torch.arange(2)})
    content = JaggedFeatures(
        torch.zeros(3, dtype=torch.int64), {"content_ids": torch.zeros(0).long()}
    )
    batch = SampleBatch(uih, cands, torch.zeros(2), content, torch.tensor([0]))
    d = 16
    qkv = 2 * d * 3 * d * (3 + 2) * 2
    per_token = 2 * d * d + 2 * (2 * d * 2 * d)  # proj, D -> 2D, 2D -> D
    cand = (per_token * 2 + 4 * d * 2 * 3) * 2  # 2 candidates x 3 keys, both blocks
    hist = per_token * 3 + 4 * d * 6  # 6 causal pairs, the first block only
    assert _model(cfg).flops(batch) == 3 * (qkv + cand + hist + 2 * d * 2)


def test_flops_add_over_samples():
    """A sum over samples: the balancer may move them between ranks."""
    m = _model()
    a, b = random_batch(8, 5, dense_dim=2), random_batch(9, 3, dense_dim=2, first_sample_id=5)
    assert m.flops(SampleBatch.concat([a, b])) == m.flops(a) + m.flops(b)
