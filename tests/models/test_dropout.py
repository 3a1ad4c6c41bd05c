"""Dropout of the built-in models: only in training steps, masks keyed by the
sample (not by the order of draws), and nothing at all at rate 0."""

import pytest
import torch

from freescale.models import hstu, sequence
from freescale.models.dropout import SampleDropout, keep_mask, mix32, row_keys, training_step
from freescale.models.hstu import HSTUConfig, HSTUModel
from freescale.models.sequence import ModelConfig, SequenceModel
from freescale.testing.batches import random_batch

RATES = {"emb_dropout": 0.3, "attn_dropout": 0.2, "ffn_dropout": 0.1}


def _model(kind: str, **rates: float) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "sequence":
        return SequenceModel(
            ModelConfig(num_items=100, dim=16, heads=2, layers=2, dense_dim=2, **rates)
        )
    return HSTUModel(HSTUConfig(num_items=100, dim=16, heads=2, layers=2, dense_dim=2, **rates))


@pytest.mark.parametrize("kind", ["sequence", "hstu"])
def test_dropout_changes_training_steps_only(kind):
    batch = random_batch(0, 6, max_uih=8, first_sample_id=40)
    plain, dropped = _model(kind), _model(kind, **RATES)
    with torch.no_grad():
        reference = plain(batch)
        assert torch.equal(dropped(batch), reference)  # no step: evaluation, export
        with training_step(dropped, seed=0, step=3):
            a = dropped(batch)
            assert torch.equal(dropped(batch), a)  # deterministic given (seed, step)
        with training_step(dropped, seed=0, step=4):
            b = dropped(batch)
        with training_step(dropped, seed=0, step=3):
            dropped.eval()
            assert torch.equal(dropped(batch), reference)  # eval mode: none either
            dropped.train()
        with training_step(plain, seed=0, step=3):
            assert torch.equal(plain(batch), reference)  # rate 0: the default's numbers
    assert not torch.equal(a, reference) and not torch.equal(a, b)


def test_masks_follow_the_sample_not_the_batch():
    """A sample's keys are the same in any batch, order or rank (its id and positions)."""
    batch = random_batch(1, 8, max_uih=10, first_sample_id=100)
    order = torch.tensor([5, 2, 7, 0])
    part = batch.select(order)
    full = row_keys(7, 3, batch.sample_id, batch.uih.offsets, batch.uih.offsets[-1].item(), 0)
    sub = row_keys(7, 3, part.sample_id, part.uih.offsets, part.uih.offsets[-1].item(), 0)
    off = batch.uih.offsets
    expected = torch.cat([full[off[i] : off[i + 1]] for i in order.tolist()])
    assert torch.equal(sub, expected)
    assert mix32(full).max() < 2**32 and full.unique().numel() == full.numel()


def test_keep_rate_and_scale():
    keys = torch.arange(4000, dtype=torch.int64) * 7919
    kept = keep_mask(keys, site=1, dim=64, p=0.3).float().mean().item()
    assert abs(kept - 0.7) < 0.01
    drop = SampleDropout(emb=0.5)
    batch = random_batch(2, 4, max_uih=6)
    with drop.step(0, 0):
        rows = drop.for_batch(batch, training=True)
    assert rows is not None and drop.for_batch(batch, training=True) is None  # step over
    x = torch.ones(batch.uih.offsets[-1].item(), 8)
    assert set(rows(x, "uih", "emb").unique().tolist()) <= {0.0, 2.0}


@pytest.mark.parametrize("module", [sequence, hstu])
def test_bad_rates_are_one_line_errors(module):
    cfg = ModelConfig if module is sequence else HSTUConfig
    for bad in (1.0, -0.1, float("nan"), "x"):
        with pytest.raises(ValueError, match=r"model\.attn_dropout must be a number in \[0, 1\)"):
            cfg(attn_dropout=bad)
