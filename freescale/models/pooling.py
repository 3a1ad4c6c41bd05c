"""Pooling shared by the built-in models."""

from __future__ import annotations

from torch import Tensor

from freescale.jagged.batch import SampleBatch
from freescale.jagged.ops import segment_ids


def mean_content(content_rows: Tensor, batch: SampleBatch) -> Tensor:
    """Mean of each candidate's content embeddings (zero when it has none)."""
    n_c = batch.num_candidates_total
    lengths = batch.candidate_lengths()
    owner = segment_ids(batch.content.offsets, content_rows.shape[0])
    sums = content_rows.new_zeros(n_c, content_rows.shape[1]).index_add(0, owner, content_rows)
    return sums / lengths.clamp(min=1).unsqueeze(-1).to(sums.dtype)
