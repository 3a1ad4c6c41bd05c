"""Loss and normalized entropy (NE), with explicit normalization.

The loss is a *sum* of per-candidate BCE terms divided by the *global*
number of candidates of the step (all ranks). Summed over ranks, gradients
are then exactly those of the mean loss over the global batch, however the
samples are split across ranks (load balancing changes local batch sizes;
the math must not change). No hidden division by the world size anywhere.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from freescale.jagged.ops import segment_ids


def bce_loss(logits: Tensor, labels: Tensor, global_count: int | Tensor) -> Tensor:
    """Σ BCE over this rank's candidates / global candidate count."""
    return bce_loss_and_sum(logits, labels, global_count)[0]


def bce_loss_and_sum(
    logits: Tensor, labels: Tensor, global_count: int | Tensor
) -> tuple[Tensor, Tensor]:
    """`bce_loss` and, detached, the Σ BCE it divides (the metrics' sum: one kernel for both)."""
    total = F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="sum")
    return total / global_count, total.detach()


def softmax_loss_and_sum(
    logits: Tensor,
    labels: Tensor,
    offsets: Tensor,
    global_count: int | Tensor,
    max_candidates: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Sampled softmax over each sample's candidates: Σ_c label_c · (logsumexp of
    its sample's logits − logit_c), / global candidate count, and that sum detached.

    Listwise where BCE is pointwise: each positive competes with its own
    sample's negatives (SASRec's data: one positive, sampled negatives), the
    loss that lifts SASRec's ranking over BCE (Klenitskiy & Vasilev 2023).
    Per sample, so moving samples between ranks never changes it. The
    samples are padded to ``[B, max_candidates]`` (no atomics: deterministic
    on CUDA too); ``max_candidates`` is read back when not given.
    """
    lengths = offsets[1:] - offsets[:-1]
    n = logits.shape[0]
    if max_candidates is None:
        max_candidates = int(lengths.max()) if lengths.numel() else 0
    sample = segment_ids(offsets, n)
    column = torch.arange(n, device=logits.device) - offsets[sample]
    x = logits.float()
    # finite padding: an empty sample's row stays finite in the backward as well
    padded = x.new_full((lengths.numel(), max(max_candidates, 1)), torch.finfo(x.dtype).min)
    padded = padded.index_put((sample, column), x)
    per_candidate = padded.logsumexp(dim=1)[sample] - x
    total = (labels.float() * per_candidate).sum()
    return total / global_count, total.detach()


def entropy(p: float) -> float:
    """Binary entropy (nats) of a base rate ``p``; 0 at p in {0, 1}."""
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def normalized_entropy(bce_sum: float, positives: float, count: float) -> float:
    """NE = mean BCE / entropy of the label base rate (1.0 = no better than the rate)."""
    if count <= 0:
        return float("nan")
    h = entropy(positives / count)
    return (bce_sum / count) / h if h > 0 else float("nan")


@torch.no_grad()
def bce_total(logits: Tensor, labels: Tensor) -> Tensor:
    """Summed BCE as a 0-d device tensor (read it later: no host sync now)."""
    return F.binary_cross_entropy_with_logits(logits.float(), labels.float(), reduction="sum")


def bce_sum(logits: Tensor, labels: Tensor) -> float:
    return float(bce_total(logits, labels))
