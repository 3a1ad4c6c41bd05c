"""Synthetic workloads for the simulator: per-sample lengths and per-rank features.

A step's samples are drawn like `freescale.data.synthetic` draws them (UIH length
lognormal(median, σ) clipped to ``cap`` then truncated to ``max_uih``; candidate
count uniform in [1, max_candidates]; content length per candidate uniform in
[0, max_content]), but only the lengths: the simulator needs no ids. Samples are
rank-major (rank 0's B, then rank 1's, ...), as in `freescale.balance.world`.

Balancing is injected, not imported (the simulator is layer 2 like the
balancer): an `Assign` callable maps a step's lengths to each sample's
destination rank; the CLI wraps the real partitioners into one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from freescale.sim.model import NUM_FEATURES


@dataclass(frozen=True)
class LengthSpec:
    """Per-sample length distribution (defaults: the h200 presets' data)."""

    median: float = 4500.0
    sigma: float = 0.55
    cap: int = 17_000
    max_uih: int = 21_000
    max_candidates: int = 8
    max_content: int = 4

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0:
            raise ValueError(f"need median > 0 and sigma >= 0, got {self.median}, {self.sigma}")
        if self.cap < 0 or self.max_uih < 0 or self.max_candidates < 1 or self.max_content < 0:
            raise ValueError(f"invalid length spec {self}")


@dataclass(frozen=True)
class StepLengths:
    """Lengths of one global step: ``uih`` and ``num_candidates`` are ``[G]``,
    ``candidate_lengths`` ``[sum N]`` grouped by sample; all int64."""

    batch_sizes: tuple[int, ...]
    uih: np.ndarray
    num_candidates: np.ndarray
    candidate_lengths: np.ndarray

    def content_per_sample(self) -> np.ndarray:
        """``[G]``: summed content length of each sample's candidates."""
        prefix = np.concatenate([[0], np.cumsum(self.candidate_lengths)])
        ends = np.cumsum(self.num_candidates)
        return prefix[ends] - prefix[ends - self.num_candidates]


# dest = assign(lengths, step): the destination rank of every global sample.
Assign = Callable[[StepLengths, int], np.ndarray]


def synthetic_step(
    spec: LengthSpec, rng: np.random.Generator, world_size: int, batch_size: int
) -> StepLengths:
    """One global step of ``world_size × batch_size`` samples."""
    g = world_size * batch_size
    raw = np.exp(math.log(spec.median) + spec.sigma * rng.standard_normal(g))
    uih = np.minimum(np.clip(np.round(raw), 0, spec.cap), spec.max_uih).astype(np.int64)
    ncand = rng.integers(1, spec.max_candidates + 1, g)
    clen = rng.integers(0, spec.max_content + 1, int(ncand.sum()))
    return StepLengths((batch_size,) * world_size, uih, ncand, clen)


def rank_features(lengths: StepLengths, dest: np.ndarray | None = None) -> np.ndarray:
    """``[W, 5]`` summed features per rank; ``dest`` ([G]) moves samples (None: stay)."""
    w = len(lengths.batch_sizes)
    if dest is None:
        dest = np.repeat(np.arange(w), lengths.batch_sizes)
    dest = np.asarray(dest, dtype=np.int64)
    if dest.shape != lengths.uih.shape or (dest.size and (dest.min() < 0 or dest.max() >= w)):
        raise ValueError(f"dest must give a rank in [0, {w}) for each of {lengths.uih.size}")
    uih = lengths.uih.astype(np.float64)
    content = lengths.content_per_sample()
    columns = (np.ones_like(uih), uih, uih * uih, lengths.num_candidates, content)
    out = np.empty((w, NUM_FEATURES))
    for j, col in enumerate(columns):
        out[:, j] = np.bincount(dest, weights=np.asarray(col, dtype=np.float64), minlength=w)
    return out


def synthetic_features(
    spec: LengthSpec,
    steps: int,
    world_size: int,
    batch_size: int,
    seed: int = 0,
    assign: Assign | None = None,
) -> np.ndarray:
    """``[steps, W, 5]`` per-rank features of ``steps`` synthetic global steps,
    each balanced by ``assign`` when given (one `synthetic_step` per step);
    unbalanced workloads take the vectorized `_unbalanced_features`."""
    if steps < 1 or world_size < 1 or batch_size < 1:
        raise ValueError(f"need steps, world_size, batch_size >= 1, got {steps}, {world_size}")
    rng = np.random.default_rng(seed)
    if assign is None:
        return _unbalanced_features(spec, rng, steps, world_size, batch_size)
    out = np.empty((steps, world_size, NUM_FEATURES))
    for i in range(steps):
        lengths = synthetic_step(spec, rng, world_size, batch_size)
        out[i] = rank_features(lengths, assign(lengths, i))
    return out


def _unbalanced_features(
    spec: LengthSpec, rng: np.random.Generator, steps: int, world_size: int, batch_size: int
) -> np.ndarray:
    """Samples stay on their rank, so only per-rank sums are needed: UIH lengths
    and candidate counts are drawn per sample (L² is where the imbalance is),
    in chunks of steps to bound memory; a rank's content total, a sum of N_r
    uniform draws on [0, max_content], is drawn as one normal with that sum's
    exact mean and variance (N_r is a few hundred: the normal is exact enough,
    and drawing every candidate would dominate the run time)."""
    out = np.empty((steps, world_size, NUM_FEATURES))
    chunk = max(1, 4_000_000 // (world_size * batch_size))
    m = spec.max_content
    for start in range(0, steps, chunk):
        k = min(chunk, steps - start)
        shape = (k, world_size, batch_size)
        raw = np.exp(math.log(spec.median) + spec.sigma * rng.standard_normal(shape))
        uih = np.minimum(np.clip(np.round(raw), 0, spec.cap), spec.max_uih)
        ncand = rng.integers(1, spec.max_candidates + 1, shape).sum(axis=2, dtype=np.float64)
        mean, var = ncand * m / 2.0, ncand * ((m + 1) ** 2 - 1) / 12.0
        content = np.maximum(0.0, np.round(mean + np.sqrt(var) * rng.standard_normal(mean.shape)))
        block = out[start : start + k]
        block[..., 0] = batch_size
        block[..., 1] = uih.sum(axis=2)
        block[..., 2] = np.square(uih).sum(axis=2)
        block[..., 3] = ncand
        block[..., 4] = content
    return out
