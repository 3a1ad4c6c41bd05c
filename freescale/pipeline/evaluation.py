"""Held-out ranking evaluation of file data (leave-one-out split, sampled negatives).

Evaluation step k gives rank r the users ``[(k * W + r) * B, ... + B)`` of
the split, so every user is evaluated exactly once over the ranks; every
rank runs the same number of steps (the last ones may be empty locally)
because a sharded table's lookup is a collective. Sums are all-reduced once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from freescale.jagged.batch import CAND_IDS
from freescale.models.ranking import SUM_FIELDS, ranking_metrics, ranking_sums


@torch.no_grad()
def evaluate_split(
    model: nn.Module,
    source: Any,
    split: str,
    rank: int,
    world: int,
    batch_size: int,
    device: torch.device,
    max_steps: int | None = None,
) -> dict[str, float]:
    """HR@10, NDCG@10, AUC and NE of ``split`` (all its users, or the first
    ``max_steps`` global evaluation batches of them)."""
    steps = source.eval_steps(world, batch_size)
    if max_steps is not None:
        steps = min(steps, max_steps)
    sums = torch.zeros(len(SUM_FIELDS), dtype=torch.float64, device=device)
    for k in range(steps):
        batch = source.eval_batch(split, k, rank, world, batch_size).to(device)
        sums += ranking_sums(model(batch), batch.labels, batch.candidates.offsets)
    if world > 1:
        dist.all_reduce(sums)
    return ranking_metrics(sums.tolist())


def popularity_baseline(source: Any, split: str, batch_size: int = 1024) -> dict[str, float]:
    """The same metrics for scores = training-split interaction counts (host only)."""
    counts = torch.from_numpy(source.popularity()).double()  # by catalogue position
    items = getattr(source, "catalogue", None)  # raw ids: their positions (none: ids are)
    sums = torch.zeros(len(SUM_FIELDS), dtype=torch.float64)
    for k in range(source.eval_steps(1, batch_size)):
        batch = source.eval_batch(split, k, 0, 1, batch_size)
        ids = batch.candidates[CAND_IDS]
        scores = counts[ids if items is None else torch.from_numpy(items.positions(ids.numpy()))]
        sums += ranking_sums(scores, batch.labels, batch.candidates.offsets)
    metrics = ranking_metrics(sums.tolist())
    metrics.pop("ne")  # counts are not logits: no loss to speak of
    return metrics
