"""The sampled-softmax loss (`model.loss=softmax`) against a per-sample loop,
on jagged candidates with empty samples and several positives."""

import pytest
import torch

from freescale.models.loss import softmax_loss_and_sum


def _loop(logits, labels, lengths):
    total, start = logits.double().sum() * 0, 0  # keeps the graph when every sample is empty
    for n in lengths:
        x, y = logits[start : start + n].double(), labels[start : start + n].double()
        if n:
            total += (y * (torch.logsumexp(x, 0) - x)).sum()
        start += n
    return total


@pytest.mark.parametrize("seed", range(6))
def test_softmax_loss_matches_a_per_sample_loop(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (int(torch.randint(0, 9, (1,), generator=g)),), generator=g)
    lengths[: min(2, len(lengths))] = torch.tensor([0, 1])[: min(2, len(lengths))]
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    n = int(offsets[-1])
    logits = (torch.randn(n, generator=g) * 4).requires_grad_()
    labels = (torch.rand(n, generator=g) < 0.4).float()
    given = None if seed % 2 else int(lengths.max()) if len(lengths) else 0
    loss, total = softmax_loss_and_sum(logits, labels, offsets, 7, given)
    want = _loop(logits.detach(), labels, lengths.tolist())
    # float32 logsumexp over <= 5 terms of magnitude <~ 16: a few ulps of the total
    torch.testing.assert_close(total.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss.double(), want / 7, rtol=1e-5, atol=1e-5)
    loss.backward()
    ref = logits.detach().double().requires_grad_()
    (_loop(ref, labels, lengths.tolist()) / 7).backward()
    torch.testing.assert_close(logits.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(logits.grad).all()


def test_softmax_prefers_the_positive():
    """One positive against its negatives: the loss falls as the positive's logit rises."""
    offsets, labels = torch.tensor([0, 3]), torch.tensor([1.0, 0.0, 0.0])
    low = softmax_loss_and_sum(torch.tensor([0.0, 1.0, 1.0]), labels, offsets, 3)[0]
    high = softmax_loss_and_sum(torch.tensor([3.0, 1.0, 1.0]), labels, offsets, 3)[0]
    assert high < low


def test_bad_loss_name_is_one_line():
    from freescale.models import ModelConfig

    with pytest.raises(ValueError, match="model loss must be one of bce, softmax"):
        ModelConfig(loss="hinge")


def test_the_trainer_sees_the_objective():
    """`has_default_loss` (the trainer's fused BCE path) is off exactly when a
    model's loss is not BCE: a built-in with loss=softmax, a subclass's objective."""
    from freescale.models import ModelConfig, SequenceModel
    from freescale.models.contract import RecModel, has_default_loss

    class Mine(RecModel):
        objective = "softmax"

    assert has_default_loss(SequenceModel(ModelConfig(num_items=10)))
    assert not has_default_loss(SequenceModel(ModelConfig(num_items=10, loss="softmax")))
    assert not has_default_loss(Mine())
