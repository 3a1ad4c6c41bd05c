"""Cost models of the simulator: per-rank compute time and α–β links (pure numpy).

Compute. A rank's forward+backward time for one local batch is modelled as a
linear function of the batch's summed cost features, the same five columns as
`freescale.balance.world.FEATURES` (kept in this order on purpose, so features
logged or rebuilt for the balancer's cost model feed the simulator as is):

    C = a + s·samples + b·ΣL + c·ΣL² + d·candidates + e·content

(ΣL² is the sum over samples of L², attention's quadratic term). All
coefficients are non-negative: a negative per-token cost is a fitting artefact,
and it would let a long batch predict less time than a short one. Step-to-step
noise is a multiplicative lognormal factor exp(σZ − σ²/2), Z ~ N(0, 1), drawn
independently per (step, rank) from a seeded generator; its mean is 1, so the
jitter widens the spread without moving the mean.

Links. A transfer of ``mb`` megabytes over one tier costs α + β·mb (latency
plus inverse bandwidth), `LinkModel`; the timeline has one per tier (intra-node,
e.g. NVLink, and inter-node, e.g. InfiniBand).

Fitting. `fit_compute_model` is non-negative least squares. With six unknowns
an exact active-set search is cheap: solve the ordinary least squares on every
subset of the columns (64 of them), keep the solutions with no negative
coefficient, return the one with the smallest residual. The columns are scaled
to unit norm first because ΣL² is ~10⁹ times the sample count.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

# Columns of a per-rank feature row; same order as freescale.balance.world.FEATURES.
FEATURES = ("samples", "uih", "uih_sq", "candidates", "content")
NUM_FEATURES = len(FEATURES)


@dataclass(frozen=True)
class ComputeModel:
    """Forward+backward milliseconds of a local batch from its summed features.

    - ``a``: per-batch constant (kernel launches, dense layers' fixed part);
    - ``s``, ``b``, ``c``, ``d``, ``e``: ms per sample, per UIH token, per
      squared UIH token, per candidate, per content id;
    - ``jitter_sigma``: σ of the multiplicative lognormal noise (0: none).
    """

    a: float
    s: float
    b: float
    c: float
    d: float
    e: float
    jitter_sigma: float = 0.0

    def __post_init__(self) -> None:
        for name in ("a", "s", "b", "c", "d", "e", "jitter_sigma"):
            value = float(getattr(self, name))
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"ComputeModel.{name} must be finite and >= 0, got {value}")

    @property
    def coefficients(self) -> np.ndarray:
        """``[5]``: the per-feature coefficients (s, b, c, d, e), FEATURES order."""
        return np.array([self.s, self.b, self.c, self.d, self.e], dtype=np.float64)

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Noise-free ms of every batch; ``features`` is ``[..., 5]``."""
        features = np.asarray(features, dtype=np.float64)
        if features.shape[-1] != NUM_FEATURES:
            raise ValueError(f"features must end in {NUM_FEATURES} columns, got {features.shape}")
        return self.a + features @ self.coefficients

    def sample(self, features: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Predicted ms times the mean-one lognormal jitter (one draw per batch)."""
        mean = self.predict(features)
        if self.jitter_sigma == 0.0:
            return mean
        sigma = self.jitter_sigma
        return mean * np.exp(sigma * rng.standard_normal(mean.shape) - 0.5 * sigma * sigma)


def fit_compute_model(
    features: np.ndarray, times_ms: np.ndarray, intercept: bool = True
) -> ComputeModel:
    """Non-negative least-squares `ComputeModel` of measured per-batch times.

    ``features``: ``[n, 5]`` summed batch features; ``times_ms``: ``[n]``.
    ``intercept=False`` forces ``a = 0``. Jitter is left at 0 (fit it from the
    residuals if needed).
    """
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(times_ms, dtype=np.float64).reshape(-1)
    if x.ndim != 2 or x.shape[1] != NUM_FEATURES or x.shape[0] != y.shape[0]:
        raise ValueError(f"need features [n, {NUM_FEATURES}] and times [n], got {x.shape}")
    if intercept:
        x = np.concatenate([np.ones((x.shape[0], 1)), x], axis=1)
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    coef = _nnls_exhaustive(x / scale, y) / scale
    if not intercept:
        coef = np.concatenate([[0.0], coef])
    return ComputeModel(*(float(v) for v in coef))


def _nnls_exhaustive(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """min ‖x·w − y‖ with w ≥ 0, by least squares on every column subset."""
    k = x.shape[1]
    best, best_res = np.zeros(k), float(y @ y)
    for size in range(1, k + 1):
        for cols in itertools.combinations(range(k), size):
            sub = list(cols)
            w_sub, *_ = np.linalg.lstsq(x[:, sub], y, rcond=None)
            if np.any(w_sub < 0):
                continue
            w = np.zeros(k)
            w[sub] = w_sub
            r = x @ w - y
            res = float(r @ r)
            if res < best_res:
                best, best_res = w, res
    return best


@dataclass(frozen=True)
class LinkModel:
    """α–β cost of one transfer on one tier: ``alpha_ms + beta_ms_per_mb · mb``."""

    alpha_ms: float
    beta_ms_per_mb: float

    def __post_init__(self) -> None:
        if not (self.alpha_ms >= 0 and self.beta_ms_per_mb >= 0):
            raise ValueError(f"LinkModel needs alpha_ms >= 0 and beta_ms_per_mb >= 0, got {self}")

    def time_ms(self, mb: np.ndarray | float) -> np.ndarray:
        """ms to move ``mb`` megabytes (10⁶ bytes); nothing to move costs nothing."""
        mb = np.asarray(mb, dtype=np.float64)
        return np.where(mb > 0, self.alpha_ms + self.beta_ms_per_mb * mb, 0.0)
