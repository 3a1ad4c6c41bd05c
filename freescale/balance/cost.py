"""`CostModel`: per-sample compute cost fitted online from measured step times.

A sample's cost is modelled as ``a + b·L + c·L² + d·N + e·sum(L_can)`` (L the
UIH length, N the candidate count, L_can the candidates' content lengths), so a
rank's compute time is the same linear form of its *summed* features (see
`freescale.balance.world.sample_features`) plus a per-step constant that does
not depend on which samples the rank holds (optimizer, fixed kernels). Every
step contributes one row per rank; the coefficients are refit by least squares
over the last ``window`` steps.

Coefficients are kept non-negative (a negative cost per token would make the
partitioner pile long samples onto one rank): columns whose coefficient comes
out negative are dropped and the rest refit, deterministically. Until enough
rows exist the ``prior`` coefficients are used.

Determinism across ranks: every rank must feed `observe` identical arguments
(all-gathered times and features), in the same order; the fit itself is plain
float64 linear algebra and gives identical results on identical inputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from freescale.balance.world import NUM_FEATURES


@dataclass(frozen=True)
class CostModelConfig:
    """``window``: steps kept for the fit; ``min_steps``: steps observed before
    the fit replaces ``prior`` (5 coefficients a..e, default cost = UIH tokens);
    ``ridge``: relative Tikhonov term that keeps ill-conditioned fits (ranks
    with near-identical features) finite."""

    window: int = 32
    min_steps: int = 3
    prior: tuple[float, ...] = (0.0, 1.0, 0.0, 0.0, 0.0)
    ridge: float = 1e-9

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 1 <= self.min_steps <= self.window:
            raise ValueError(f"min_steps must lie in [1, window], got {self.min_steps}")
        if len(self.prior) != NUM_FEATURES or min(self.prior) < 0:
            raise ValueError(f"prior must be {NUM_FEATURES} non-negative coefficients")
        if not sum(self.prior) > 0:
            raise ValueError("prior must have a positive coefficient")
        if not 0.0 <= self.ridge < 1.0:
            raise ValueError(f"ridge must lie in [0, 1), got {self.ridge}")


class CostModel:
    """Online least-squares fit of per-sample cost coefficients (see module doc)."""

    def __init__(self, config: CostModelConfig | None = None) -> None:
        self.config = config or CostModelConfig()
        self._rows: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=self.config.window)
        self._coef = np.asarray(self.config.prior, dtype=np.float64)
        self._intercept = 0.0

    @property
    def fitted(self) -> bool:
        """Whether the coefficients come from measurements (not the prior)."""
        return len(self._rows) >= self.config.min_steps

    @property
    def coefficients(self) -> tuple[float, ...]:
        """Per-sample cost coefficients (a, b, c, d, e)."""
        return tuple(float(c) for c in self._coef)

    @property
    def intercept(self) -> float:
        """Fitted per-rank per-step constant (not part of any sample's cost)."""
        return self._intercept

    def observe(
        self, per_rank_features: Tensor | np.ndarray, per_rank_times: Sequence[float] | Tensor
    ) -> None:
        """Add one step: ``[W, 5]`` summed features and ``[W]`` compute times."""
        feats = np.asarray(torch.as_tensor(per_rank_features, dtype=torch.float64))
        times = np.asarray(torch.as_tensor(per_rank_times, dtype=torch.float64)).reshape(-1)
        if feats.ndim != 2 or feats.shape[1] != NUM_FEATURES or feats.shape[0] != times.size:
            raise ValueError(
                f"need [W, {NUM_FEATURES}] features and [W] times, got {feats.shape}"
                f" and {times.shape}"
            )
        if not (np.isfinite(feats).all() and np.isfinite(times).all()):
            raise ValueError("features and times must be finite")
        if (feats < 0).any() or (times < 0).any():
            raise ValueError("features and times must be >= 0")
        self._rows.append((feats.copy(), times.copy()))
        if self.fitted:
            self._refit()

    def state_dict(self) -> dict[str, Any]:
        """Everything the fit depends on (checkpoints): rows, coefficients, intercept.

        Arrays go out as float64 tensors (exact): a checkpoint of tensors loads
        with ``weights_only=True``, one of ndarrays would not.
        """
        return {
            "rows": [
                (torch.from_numpy(f.copy()), torch.from_numpy(t.copy())) for f, t in self._rows
            ],
            "coef": torch.from_numpy(self._coef.copy()),
            "intercept": self._intercept,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rows = ((_array(f), _array(t)) for f, t in state["rows"])
        self._rows = deque(rows, maxlen=self.config.window)
        self._coef = _array(state["coef"])
        self._intercept = float(state["intercept"])

    def predict(self, features: Tensor) -> Tensor:
        """Cost of each row of ``features`` (``[..., 5]``; per sample or summed), float64."""
        feats = features.to(torch.float64)
        if feats.shape[-1] != NUM_FEATURES:
            raise ValueError(f"features must end in {NUM_FEATURES} columns, got {feats.shape}")
        # Column by column, not a matmul: elementwise float64 ops give bit-identical
        # costs on every rank whatever BLAS and thread count each one uses.
        out = torch.zeros(feats.shape[:-1], dtype=torch.float64)
        for j, c in enumerate(self._coef.tolist()):
            if c:
                out += feats[..., j] * c
        return out

    def _refit(self) -> None:
        feats = np.concatenate([f for f, _ in self._rows])
        times = np.concatenate([t for _, t in self._rows])
        # Column 0 of the design is the per-step intercept, then the 5 features.
        design = np.concatenate([np.ones((feats.shape[0], 1)), feats], axis=1)
        solution = _nonnegative_lstsq(design, times, self.config.ridge)
        if solution is None:
            return
        self._intercept = float(solution[0])
        self._coef = solution[1:]
        if not self._coef.any():  # nothing explains the times: keep a usable model
            self._coef = np.asarray(self.config.prior, dtype=np.float64)


def _nonnegative_lstsq(design: np.ndarray, target: np.ndarray, ridge: float) -> np.ndarray | None:
    """Least squares with all coefficients >= 0, by dropping the most negative
    column and refitting until none is negative (an active-set heuristic that
    is exact for the common one-negative case and always deterministic)."""
    n_cols = design.shape[1]
    scale = np.sqrt((design * design).sum(axis=0))
    active = [j for j in range(n_cols) if scale[j] > 0]
    while active:
        x = design[:, active] / scale[active]
        # Ridge rows: sqrt(ridge) * I appended, relative to the unit-scaled columns.
        x = np.concatenate([x, np.sqrt(ridge) * np.eye(len(active))])
        y = np.concatenate([target, np.zeros(len(active))])
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        coef = coef / scale[active]
        if not np.isfinite(coef).all():
            return None
        if (coef >= 0).all():
            out = np.zeros(n_cols)
            out[active] = coef
            return out
        del active[int(np.argmin(coef))]
    return np.zeros(n_cols)


def _array(x: Tensor | np.ndarray) -> np.ndarray:
    """A float64 ndarray of its own (state dicts hold tensors; older ones ndarrays)."""
    return np.array(torch.as_tensor(x, dtype=torch.float64).numpy(), dtype=np.float64)
