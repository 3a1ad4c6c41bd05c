"""Turn user histories into training samples (UIH prefix -> next items)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from freescale.data.readers import SequenceDataset
from freescale.data.synthetic import RawSample, samples_to_batch
from freescale.jagged.batch import SampleBatch


@dataclass(frozen=True)
class SequenceSampling:
    """How a history of length n becomes samples.

    Split point t: UIH = the (at most ``max_uih``) items before t, candidates =
    the ``num_positives`` items from t on (label 1) plus ``num_negatives``
    items drawn uniformly from the vocabulary (label 0; an accidental hit on
    a real next item is kept as a negative, as in the usual sampled-softmax
    set-up), shuffled. Each user gives up to ``samples_per_user`` split points,
    the last one at ``n - num_positives``, then every ``stride`` items earlier.
    """

    max_uih: int = 200
    num_positives: int = 1
    num_negatives: int = 4
    samples_per_user: int = 1
    stride: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.max_uih < 0 or self.num_negatives < 0:
            raise ValueError("max_uih and num_negatives must be >= 0")
        if self.num_positives < 1 or self.samples_per_user < 1 or self.stride < 1:
            raise ValueError("num_positives, samples_per_user and stride must be >= 1")


class SequenceSource:
    """A finite `DataSource` over a `SequenceDataset`.

    Samples are ordered by the time of their first candidate (temporal order),
    ties broken by user; global step s covers samples
    ``[s * W * B, (s + 1) * W * B)`` and an incomplete last global batch is dropped.
    """

    def __init__(self, dataset: SequenceDataset, sampling: SequenceSampling | None = None):
        self.dataset = dataset
        self.sampling = sampling or SequenceSampling()
        self.num_items = dataset.num_items
        s = self.sampling
        index = []
        for u, h in enumerate(dataset.users):
            n = h.items.size
            for k in range(s.samples_per_user):
                t = n - s.num_positives - k * s.stride
                if t < 1:
                    break
                index.append((int(h.timestamps[t]), u, t))
        index.sort()
        self.index = [(u, t) for _, u, t in index]

    def __len__(self) -> int:
        return len(self.index)

    def num_steps(self, world_size: int, batch_size: int) -> int:
        return len(self.index) // max(world_size * batch_size, 1)

    def raw_sample(self, g: int, max_uih: int | None = None) -> RawSample:
        s = self.sampling
        u, t = self.index[g]
        h = self.dataset.users[u]
        lo = max(0, t - (s.max_uih if max_uih is None else max_uih))
        rng = np.random.default_rng([s.seed, g])
        pos = h.items[t : t + s.num_positives]
        neg = rng.integers(0, self.num_items, s.num_negatives)
        order = rng.permutation(pos.size + neg.size)
        cand = np.concatenate([pos, neg])[order]
        labels = np.concatenate([np.ones(pos.size), np.zeros(neg.size)])[order]
        return RawSample(
            uih_ids=h.items[lo:t],
            actions=h.actions[lo:t],
            timestamps=h.timestamps[lo:t],
            cand_ids=cand.astype(np.int64),
            labels=labels.astype(np.float32),
            content_lengths=np.zeros(cand.size, dtype=np.int64),
            content_ids=np.zeros(0, dtype=np.int64),
            dense=np.zeros(0, dtype=np.float32),
        )

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> SampleBatch:
        if not 0 <= step < self.num_steps(world_size, batch_size) or not 0 <= rank < world_size:
            raise ValueError(
                f"step {step} rank {rank}/{world_size} is outside this dataset "
                f"({self.num_steps(world_size, batch_size)} steps of {world_size}x{batch_size})"
            )
        first = (step * world_size + rank) * batch_size
        ids = torch.arange(first, first + batch_size, dtype=torch.int64)
        return samples_to_batch(
            [self.raw_sample(g) for g in range(first, first + batch_size)], ids, 0
        )
