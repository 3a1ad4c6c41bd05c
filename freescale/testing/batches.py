"""Random `SampleBatch`es for tests, with the awkward shapes made likely."""

from __future__ import annotations

import torch

from freescale.jagged.batch import (
    CAND_IDS,
    CONTENT_IDS,
    UIH_ACTIONS,
    UIH_IDS,
    UIH_TIMESTAMPS,
    SampleBatch,
)
from freescale.jagged.ops import lengths_to_offsets
from freescale.jagged.tensor import JaggedFeatures


def random_batch(
    seed: int,
    batch_size: int,
    max_uih: int = 8,
    max_candidates: int = 3,
    max_content: int = 3,
    num_items: int = 100,
    dense_dim: int | None = 2,
    first_sample_id: int = 0,
) -> SampleBatch:
    """A batch whose lengths are drawn from ``[0, max]`` (zero-length UIH,
    zero candidates and empty content all occur)."""
    g = torch.Generator().manual_seed(seed)

    def lengths(n: int, hi: int) -> torch.Tensor:
        return torch.randint(0, hi + 1, (n,), generator=g)

    uih_len = lengths(batch_size, max_uih)
    n_cand = lengths(batch_size, max_candidates)
    total_uih, total_cand = int(uih_len.sum()), int(n_cand.sum())
    content_len = lengths(total_cand, max_content)
    total_content = int(content_len.sum())
    uih = JaggedFeatures(
        lengths_to_offsets(uih_len),
        {
            UIH_IDS: torch.randint(0, num_items, (total_uih,), generator=g),
            UIH_ACTIONS: torch.randint(0, 4, (total_uih,), generator=g),
            UIH_TIMESTAMPS: torch.randint(0, 10**6, (total_uih,), generator=g),
        },
    )
    candidates = JaggedFeatures(
        lengths_to_offsets(n_cand),
        {CAND_IDS: torch.randint(0, num_items, (total_cand,), generator=g)},
    )
    content = JaggedFeatures(
        lengths_to_offsets(content_len),
        {CONTENT_IDS: torch.randint(0, num_items, (total_content,), generator=g)},
    )
    dense = None if dense_dim is None else torch.randn(batch_size, dense_dim, generator=g)
    return SampleBatch(
        uih=uih,
        candidates=candidates,
        labels=torch.randint(0, 2, (total_cand,), generator=g).float(),
        content=content,
        sample_id=torch.arange(first_sample_id, first_sample_id + batch_size),
        dense=dense,
    )
