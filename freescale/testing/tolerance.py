"""Tolerances that follow from the computation, not from one machine.

Two float computations of the same quantity that differ only in the order
of their additions (another thread count, another SIMD width, a padded vs
an unpadded layout, a fused kernel vs torch) disagree by rounding error.
For a sum of ``n`` terms whose absolute values add up to ``S``, each
addition rounds by at most ``u·|partial sum| ≤ u·S`` (``u = eps / 2``, the
unit roundoff). Rounding errors of a reordered sum behave like a random
walk: their spread grows like ``sqrt(n)``, not ``n`` (Higham, *Accuracy and
Stability of Numerical Algorithms*, §2.8 and §4.2), so

    |a - b| ≤ K · eps · sqrt(n) · S        (K = 4)

holds for two orders of the same sum: each side's error has a standard
deviation of about ``0.29 · eps · sqrt(n) · S``, so the difference is
≈ 0.41·eps·sqrt(n)·S per sigma and K = 4 is ten of them. A computation that
chains ``depth`` such reductions (a layer's forward, then its backward, a
stack of layers) compounds them: the bound is multiplied by ``depth``.

Use this for every comparison the design calls *close*. Comparisons the
design calls *exact* (modes, sharded vs unsharded, resume, prioritized vs
sync) use ``torch.equal`` and never a tolerance.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

# Ten standard deviations of the difference of two reordered sums (above).
SAFETY = 4.0


def eps_of(dtype: torch.dtype | np.dtype | type) -> float:
    """Machine epsilon of a torch or numpy floating dtype."""
    if isinstance(dtype, torch.dtype):
        return torch.finfo(dtype).eps
    return float(np.finfo(dtype).eps)


def reduction_tol(
    dtype: torch.dtype | np.dtype | type,
    terms: int,
    magnitude: float,
    depth: int = 1,
) -> dict[str, float]:
    """``atol``/``rtol`` for two orders of a computation over ``terms``-long sums.

    ``magnitude`` is ``S``: the sum of the absolute values of the terms of
    one reduction (bounded by ``terms · max|term|``), i.e. the size of what
    is being accumulated, not of the result (a sum can cancel to ~0 while
    its rounding error stays ``eps · S``). ``depth`` counts chained
    reductions. ``rtol`` covers results far larger than their terms'
    rounding (products, not sums).
    """
    if terms < 1 or depth < 1:
        raise ValueError(f"terms and depth must be >= 1, got {terms}, {depth}")
    bound = SAFETY * eps_of(dtype) * math.sqrt(terms) * depth
    return {"atol": bound * max(float(magnitude), 0.0), "rtol": bound}


def abs_sum(x: torch.Tensor | np.ndarray) -> float:
    """``S`` of a reduction whose terms are ``x`` (a convenient upper bound)."""
    if isinstance(x, torch.Tensor):
        return float(x.detach().double().abs().sum())
    return float(np.abs(np.asarray(x, dtype=np.float64)).sum())


def assert_reordered_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    terms: int,
    magnitude: float | None = None,
    depth: int = 1,
    dtype: torch.dtype | None = None,
    **kwargs: Any,
) -> None:
    """``torch.testing.assert_close`` with :func:`reduction_tol`'s tolerance.

    ``magnitude`` defaults to ``sqrt(terms) · max|expected|``: the ``S`` of
    terms of random sign (gradients, activations), whose sum grows like
    ``sqrt(n)`` times a term while their absolute sum grows like ``n``; it
    also covers terms of one sign (``S = |sum|``). Pass the real ``S`` when
    the terms cancel further. ``dtype`` defaults to the lower-precision
    operand's.
    """
    if dtype is None:
        dtype = min((actual.dtype, expected.dtype), key=lambda d: torch.finfo(d).bits)
    if magnitude is None:
        peak = float(expected.detach().double().abs().max()) if expected.numel() else 0.0
        magnitude = math.sqrt(terms) * peak
    tol = reduction_tol(dtype, terms, magnitude, depth)
    torch.testing.assert_close(actual, expected, **tol, **kwargs)


def lstsq_tol(design: np.ndarray, magnitude: float) -> dict[str, float]:
    """Tolerance of a least-squares solution (float64) against the exact one.

    A perturbation of relative size ``eps`` in the data moves the solution by
    about ``cond(A)² · eps`` relative to its size (normal equations, as the
    cost model's running fit uses; Higham §20.1). ``magnitude``: size of the
    solution.
    """
    cond = float(np.linalg.cond(np.asarray(design, dtype=np.float64)))
    rel = SAFETY * eps_of(np.float64) * cond * cond * design.shape[0]
    return {"rtol": rel, "atol": rel * max(float(magnitude), 0.0)}


def sampling_tol(values: np.ndarray, sigmas: float = 5.0) -> float:
    """Half-width of a ``sigmas``-sigma interval of the mean of ``values``.

    For Monte Carlo comparisons: two estimates of one expectation from
    independent draws differ by sampling error, which the draws themselves
    measure (standard error of the mean). Five sigma: a false alarm in
    about one run in 1.7 million.
    """
    v = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
    stderr = v.std(axis=0, ddof=1) / math.sqrt(v.shape[0])
    return float(sigmas * stderr.max())
