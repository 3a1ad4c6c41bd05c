"""Ranking metrics of a held-out target among sampled negatives (SASRec protocol).

Each evaluated sample has exactly one positive candidate (its held-out item)
and some negatives. Per sample: g negatives score above the positive, t tie
with it. Ties are broken at random, so the metrics are their expectations
over tie orders (a model that scores everything alike gets chance values,
not perfect or zero ones):

- HR@k: P(rank < k), the rank uniform on g..g+t;
- NDCG@k: E[1 / log2(rank + 2) if rank < k];
- AUC: the share of negatives ranked below the positive (ties: one half),
  averaged over samples with at least one negative.

Every value is a sum over samples, so ranks add their sums (one all-reduce)
and each user counts once whatever the world size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from freescale.jagged.ops import segment_ids
from freescale.models.loss import normalized_entropy

SUM_FIELDS = ("users", "hits", "ndcg", "auc", "auc_users", "bce", "positives", "candidates")


def ranking_sums(logits: Tensor, labels: Tensor, offsets: Tensor, k: int = 10) -> Tensor:
    """Per-field sums (``SUM_FIELDS``) over the samples of one batch, float64."""
    n = labels.numel()
    samples = offsets.numel() - 1
    out = torch.zeros(len(SUM_FIELDS), dtype=torch.float64, device=labels.device)
    if samples <= 0 or n == 0:
        return out
    scores = logits.detach().float()
    seg = segment_ids(offsets, n)
    positive = labels > 0.5
    pos_score = scores.new_zeros(samples).index_put_((seg[positive],), scores[positive])
    negative = ~positive
    rival = scores - pos_score[seg]

    def per_sample(mask: Tensor) -> Tensor:
        return torch.zeros(samples, dtype=torch.float64, device=labels.device).index_add_(
            0, seg, mask.double()
        )

    greater = per_sample(negative & (rival > 0))
    ties = per_sample(negative & (rival == 0))
    negatives = per_sample(negative)
    r = torch.arange(k, dtype=torch.float64, device=labels.device)
    in_reach = (r >= greater[:, None]) & (r <= (greater + ties)[:, None])
    hits = in_reach.double().sum(1) / (ties + 1)
    ndcg = (in_reach.double() / torch.log2(r + 2)).sum(1) / (ties + 1)
    has_neg = negatives > 0
    auc = (negatives - greater - 0.5 * ties) / negatives.clamp(min=1)
    bce = F.binary_cross_entropy_with_logits(scores.double(), labels.double(), reduction="sum")
    out[:] = torch.stack(
        [
            torch.tensor(float(samples), dtype=torch.float64, device=labels.device),
            hits.sum(),
            ndcg.sum(),
            auc[has_neg].sum(),
            has_neg.double().sum(),
            bce,
            labels.double().sum(),
            torch.tensor(float(n), dtype=torch.float64, device=labels.device),
        ]
    )
    return out


def ranking_metrics(sums: Tensor | list[float], k: int = 10) -> dict[str, float]:
    """Means from summed ``ranking_sums`` (all ranks' sums added)."""
    s = dict(zip(SUM_FIELDS, [float(x) for x in sums], strict=True))
    users = max(s["users"], 1.0)
    return {
        "users": int(s["users"]),
        f"hr@{k}": s["hits"] / users,
        f"ndcg@{k}": s["ndcg"] / users,
        "auc": s["auc"] / max(s["auc_users"], 1.0),
        "ne": normalized_entropy(s["bce"], s["positives"], s["candidates"]),
        "negatives_per_user": (s["candidates"] - s["positives"]) / users,
    }
