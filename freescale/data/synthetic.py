"""Seeded synthetic `SampleBatch`es with long-tail UIH lengths and Zipf item ids.

Sample ``g`` (a global sample index) is a pure function of ``(seed, g)``, so
the global batch of a step is the same whatever the world size, and every
rank can generate its own slice with no communication:
rank ``r`` of ``W`` at step ``s`` with local batch ``B`` holds samples
``g = (s * W + r) * B + i`` for ``i < B`` (a resumed run may start its steps
elsewhere in the stream: `freescale.data.stream`).

``raw_ids``: every item id of a batch (history, candidates, content) is sent
through a fixed random injective 64-bit map of the seed (`raw_id_map`),
after everything else is drawn: the batches are those without it, each row
replaced by its 64-bit id (the ids a dynamic item table is made for).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from freescale.data.distributions import IdScramble, LengthDistribution, zipf_ranks
from freescale.data.ids import raw_id_map
from freescale.data.stream import SampleStream
from freescale.jagged.batch import (
    CAND_IDS,
    CONTENT_IDS,
    UIH_ACTIONS,
    UIH_IDS,
    UIH_TIMESTAMPS,
    SampleBatch,
)
from freescale.jagged.ops import lengths_to_offsets
from freescale.jagged.schema import DataSchema, Feature
from freescale.jagged.tensor import JaggedFeatures


@dataclass(frozen=True)
class SyntheticConfig:
    """What the generator draws. Defaults: the shapes of the paper's Fig. 2 and 3."""

    num_items: int = 100_000_000
    zipf_alpha: float = 1.05
    max_uih: int = 21_000
    lengths: LengthDistribution = field(default_factory=LengthDistribution)
    max_candidates: int = 8
    max_content: int = 4
    num_actions: int = 4
    dense_dim: int = 0
    latent_dim: int = 8
    latent_buckets: int = 4096
    signal: float = 3.0
    seed: int = 0
    # Share of ids drawn from the popularity law common to all steps; the rest
    # is moved to rows private to the step, so consecutive steps collide less
    # (1.0: the plain Zipf stream; 0.0: consecutive steps share almost no row).
    step_overlap: float = 1.0
    raw_ids: bool = False  # item ids through a fixed random 64-bit map (module docstring)

    def __post_init__(self) -> None:
        positive = {
            "num_items": self.num_items,
            "max_candidates": self.max_candidates,
            "num_actions": self.num_actions,
            "latent_dim": self.latent_dim,
            "latent_buckets": self.latent_buckets,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"synthetic {name} must be >= 1, got {value}")
        if self.max_uih < 0 or self.max_content < 0 or self.dense_dim < 0:
            raise ValueError("max_uih, max_content and dense_dim must be >= 0")
        if self.zipf_alpha <= 0:
            raise ValueError(f"zipf_alpha must be > 0, got {self.zipf_alpha}")
        if not 0.0 <= self.step_overlap <= 1.0:
            raise ValueError(f"step_overlap must lie in [0, 1], got {self.step_overlap}")


@dataclass
class RawSample:
    """One sample as host arrays (full history, before truncation)."""

    uih_ids: np.ndarray
    actions: np.ndarray
    timestamps: np.ndarray
    cand_ids: np.ndarray
    labels: np.ndarray
    content_lengths: np.ndarray
    content_ids: np.ndarray
    dense: np.ndarray
    # the data's own features (`freescale.jagged.schema`): per history event
    # (aligned with ``uih_ids``) and per candidate (aligned with ``cand_ids``)
    uih_features: dict[str, np.ndarray] = field(default_factory=dict)
    cand_features: dict[str, np.ndarray] = field(default_factory=dict)
    content_features: dict[str, np.ndarray] = field(default_factory=dict)  # with content_ids


class GroundTruth:
    """The hidden model that labels candidates, so a learner can beat the base rate.

    P(label = 1) = sigmoid(bias[item] + signal * <user, latent[item]>), where
    ``user`` is the mean latent vector of the (truncated) UIH. Items share
    latent vectors through ``latent_buckets`` hash buckets, so memory stays
    bounded for any table size.
    """

    def __init__(self, cfg: SyntheticConfig) -> None:
        rng = np.random.default_rng([cfg.seed, 0x6774])
        d = cfg.latent_dim
        self.latent = rng.standard_normal((cfg.latent_buckets, d)) / np.sqrt(d)
        self.bias = rng.normal(-0.8, 1.2, cfg.latent_buckets)
        self.buckets = cfg.latent_buckets
        self.signal = cfg.signal

    def bucket(self, ids: np.ndarray) -> np.ndarray:
        return (ids * 2654435761) % self.buckets

    def probability(self, uih_ids: np.ndarray, cand_ids: np.ndarray) -> np.ndarray:
        cb = self.bucket(cand_ids)
        if uih_ids.size:
            user = self.latent[self.bucket(uih_ids)].mean(axis=0) * np.sqrt(self.latent.shape[1])
        else:
            user = np.zeros(self.latent.shape[1])
        logit = self.bias[cb] + self.signal * (self.latent[cb] @ user)
        return 1.0 / (1.0 + np.exp(-logit))


class SyntheticSource(SampleStream):
    """A `DataSource` of synthetic samples; infinite (``num_steps`` is None)."""

    def __init__(self, config: SyntheticConfig | None = None) -> None:
        self.config = config or SyntheticConfig()
        self.num_items = self.config.num_items
        self.num_actions = self.config.num_actions
        self.scramble = IdScramble.make(self.config.num_items, self.config.seed)
        self.truth = GroundTruth(self.config)
        self.schema = DataSchema.standard(
            self.num_items, self.num_actions, raw_items=self.config.raw_ids
        )

    def num_steps(self, world_size: int, batch_size: int) -> int | None:
        return None

    def item_ids(self, rng: np.random.Generator, n: int) -> np.ndarray:
        cfg = self.config
        return self.scramble(zipf_ranks(rng, n, cfg.num_items, cfg.zipf_alpha))

    def raw_sample(self, g: int, max_uih: int | None = None) -> RawSample:
        """Sample ``g``; its UIH keeps the most recent ``max_uih`` items."""
        cfg = self.config
        max_uih = cfg.max_uih if max_uih is None else max_uih
        rng = np.random.default_rng([cfg.seed, g])
        full_len = int(cfg.lengths.sample(rng, 1)[0])
        length = min(full_len, max_uih)
        # Draw the whole history so truncation keeps the same recent items.
        history = self.item_ids(rng, full_len)
        uih_ids = history[full_len - length :]
        gaps = rng.exponential(60.0, full_len).cumsum()[full_len - length :]
        timestamps = (g * 1_000_000 + gaps).astype(np.int64)
        actions = rng.integers(0, cfg.num_actions, full_len)[full_len - length :]
        n_cand = int(rng.integers(1, cfg.max_candidates + 1))
        cand_ids = self.item_ids(rng, n_cand)
        labels = (rng.random(n_cand) < self.truth.probability(uih_ids, cand_ids)).astype(np.float32)
        content_lengths = rng.integers(0, cfg.max_content + 1, n_cand)
        content_ids = self.item_ids(rng, int(content_lengths.sum()))
        dense = rng.standard_normal(cfg.dense_dim).astype(np.float32)
        return RawSample(
            uih_ids, actions, timestamps, cand_ids, labels, content_lengths, content_ids, dense
        )

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> SampleBatch:
        """Rank ``rank``'s local batch of global step ``step``."""
        first = self.first_position(step, rank, world_size, batch_size)
        if not 0 <= rank < world_size or batch_size < 0 or step < 0 or first < 0:
            raise ValueError(
                f"bad batch request: step={step} rank={rank}/{world_size} batch_size={batch_size}"
            )
        samples = [self.raw_sample(g) for g in range(first, first + batch_size)]
        if self.config.step_overlap < 1.0:
            samples = [self._step_private(s, step, g) for g, s in enumerate(samples, first)]
        if self.config.raw_ids:
            samples = [self._raw(s) for s in samples]
        return samples_to_batch(
            samples,
            torch.arange(first, first + batch_size, dtype=torch.int64),
            self.config.dense_dim,
        )

    def _raw(self, sample: RawSample) -> RawSample:
        """``sample`` with its item rows sent through the 64-bit map."""
        seed = self.config.seed
        return replace(
            sample, uih_ids=raw_id_map(sample.uih_ids, seed),
            cand_ids=raw_id_map(sample.cand_ids, seed),
            content_ids=raw_id_map(sample.content_ids, seed),
        )  # fmt: skip

    def _step_private(self, sample: RawSample, step: int, g: int) -> RawSample:
        """Move a ``1 - step_overlap`` share of the sample's ids (chosen by a
        seeded draw per id) to rows shifted by a step-dependent offset: the
        same popularity, but rows that the neighbouring steps do not read."""
        rng = np.random.default_rng([self.config.seed, g, 0x5EED])
        n = self.config.num_items
        shift = (step + 1) * 0x9E3779B1 % n  # odd multiplier: steps land far apart

        def move(ids: np.ndarray) -> np.ndarray:
            private = rng.random(ids.size) >= self.config.step_overlap
            return np.where(private, (ids + shift) % n, ids)

        return RawSample(
            move(sample.uih_ids), sample.actions, sample.timestamps, move(sample.cand_ids),
            sample.labels, sample.content_lengths, move(sample.content_ids), sample.dense,
        )  # fmt: skip


def samples_to_batch(
    samples: list[RawSample],
    sample_id: torch.Tensor,
    dense_dim: int,
    extra: Sequence[Feature] = (),
) -> SampleBatch:
    """Stack host samples into one `SampleBatch` (int64 ids, float32 labels);
    ``extra``: the uih-, candidates- and content-level features the samples carry
    (present, empty, in a batch of no samples too)."""

    def cat(arrays: list[np.ndarray], dtype: torch.dtype) -> torch.Tensor:
        if not arrays:
            return torch.zeros(0, dtype=dtype)
        return torch.from_numpy(np.concatenate(arrays)).to(dtype)

    def offsets(counts: list[int] | np.ndarray) -> torch.Tensor:
        return lengths_to_offsets(torch.as_tensor(np.asarray(counts, dtype=np.int64)))

    i64 = torch.int64
    uih = JaggedFeatures(
        offsets([s.uih_ids.size for s in samples]),
        {
            UIH_IDS: cat([s.uih_ids for s in samples], i64),
            UIH_ACTIONS: cat([s.actions for s in samples], i64),
            UIH_TIMESTAMPS: cat([s.timestamps for s in samples], i64),
            **{
                f.name: cat([s.uih_features[f.name] for s in samples], i64)
                for f in extra
                if f.level == "uih"
            },
        },
    )
    candidates = JaggedFeatures(
        offsets([s.cand_ids.size for s in samples]),
        {
            CAND_IDS: cat([s.cand_ids for s in samples], i64),
            **{
                f.name: cat([s.cand_features[f.name] for s in samples], i64)
                for f in extra
                if f.level == "candidates"
            },
        },
    )
    content = JaggedFeatures(
        offsets(np.concatenate([s.content_lengths for s in samples]) if samples else []),
        {
            CONTENT_IDS: cat([s.content_ids for s in samples], i64),
            **{
                f.name: cat([s.content_features[f.name] for s in samples], i64)
                for f in extra
                if f.level == "content"
            },
        },
    )
    dense = None
    if dense_dim:
        dense = torch.from_numpy(np.stack([s.dense for s in samples]).reshape(-1, dense_dim))
    return SampleBatch(
        uih=uih,
        candidates=candidates,
        labels=cat([s.labels for s in samples], torch.float32),
        content=content,
        sample_id=sample_id,
        dense=dense,
    )
