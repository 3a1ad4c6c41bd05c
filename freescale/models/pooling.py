"""Pooling shared by the built-in models."""

from __future__ import annotations

from torch import Tensor

from freescale.jagged.batch import SampleBatch
from freescale.jagged.ops import segment_ids


def segment_mean(values: Tensor, offsets: Tensor) -> Tensor:
    """Mean of each segment's rows of ``values`` (zero for an empty segment):
    a user's history from ``batch.uih.offsets``, a candidate's content from
    ``batch.content.offsets``."""
    owner = segment_ids(offsets, values.shape[0])
    sums = values.new_zeros(offsets.numel() - 1, values.shape[1]).index_add(0, owner, values)
    return sums / offsets.diff().clamp(min=1).unsqueeze(-1).to(sums.dtype)


def mean_content(content_rows: Tensor, batch: SampleBatch) -> Tensor:
    """Mean of each candidate's content embeddings (zero when it has none)."""
    return segment_mean(content_rows, batch.content.offsets)
