"""Tolerances that follow from the computation, not from one machine.

Every comparison the tests call *close* takes its tolerance from here;
comparisons the design calls *exact* (modes, sharded vs unsharded where it is
bitwise, resume, prioritized vs sync) use ``torch.equal`` and none.

**Reordered sums.** Two float computations of the same quantity that differ
only in the order of their additions (another thread count, another SIMD
width, a padded vs an unpadded layout, a fused kernel vs torch) disagree by
rounding error. For a sum of ``n`` terms whose absolute values add up to
``S``, each addition rounds by at most ``u·|partial sum| ≤ u·S`` (``u = eps /
2``, the unit roundoff). Rounding errors of a reordered sum behave like a
random walk: their spread grows like ``sqrt(n)``, not ``n`` (Higham,
*Accuracy and Stability of Numerical Algorithms*, §2.8 and §4.2), so

    |a - b| ≤ K · eps · sqrt(n) · S        (K = 4)

holds for two orders of the same sum: each side's error has a standard
deviation of about ``0.29 · eps · sqrt(n) · S``, so the difference is
≈ 0.41·eps·sqrt(n)·S per sigma and K = 4 is ten of them. A computation that
chains ``depth`` such reductions (a layer's forward, then its backward, a
stack of layers) compounds them: the bound is multiplied by ``depth``. A
result stored in a narrower dtype than it was accumulated in (fp32 sums
written as bf16) can in addition land on neighbouring representable values:
one ulp, ``eps(output)`` relative (``reduction_tol(..., output=)``). The
bound only needs ``S`` through the partial sums: when the terms are drawn
independently with zero mean (the tests' ``randn`` data), every partial sum
of ``k`` of them stays within a few ``sqrt(k)·rms`` and `random_sum_size` is
the (much smaller, for long sums) size to pass instead. Float64
Python/numpy sums compared against a bound they should meet get the same
bound as slack (`sum_slack`).

**Training runs.** Two runs of ``k`` optimizer steps whose steps differ by
reordered reductions: each step adds its own rounding difference to the
parameters, and later steps carry it along without amplifying it while the
update is non-expanding (SGD with ``lr`` below the curvature's limit,
Adagrad, Adam with its second moment away from zero; a few steps of the small
models here). So the per-step bound adds up: ``depth × steps``
(`steps_tol`). Adam is the exception where a gradient is within rounding of
zero: its step ``lr·m̂/(sqrt(v̂)+ε)`` has size up to ~``lr`` whatever the
gradient's size, so the two runs' signs may differ and such a parameter can
part by up to twice the largest step, every step (`adam_drift`).

**Least squares.** A least-squares solution computed by QR/SVD
(``np.linalg.lstsq``, as the cost models fit, on column-scaled designs) moves
under a relative perturbation ``η`` of its data by (Higham §20.1, Wedin)

    ‖Δz‖ / ‖z‖ ≤ η · κ · (2 + (κ + 1) · ‖r‖ / (‖B‖ · ‖z‖))

with ``B`` the scaled design, ``κ`` its condition number and ``r`` the
residual; ``η = K · eps · sqrt(m·n)`` is the backward error of the
factorization of an ``m × n`` design (random-walk form of ``γ_{mn}``).
Unscaled, coefficient ``j`` moves by ``‖Δz‖ / scale_j`` (`lstsq_tol`).
Normal equations would square ``κ``; nothing here solves them.

**Sampling.** Monte Carlo estimates differ from their expectation (or from
another estimate with independent draws) by sampling error, which the draws
themselves measure: the standard error of a mean (`sampling_tol`), of a
standard deviation (`std_tol`) or of regression coefficients fitted to noisy
data (`regression_tol`, the heteroscedasticity-robust sandwich). Five sigma:
a false alarm about once in 1.7 million runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
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
    *,
    output: torch.dtype | None = None,
) -> dict[str, float]:
    """``atol``/``rtol`` for two orders of a computation over ``terms``-long sums.

    ``dtype`` is the dtype the sums accumulate in; ``magnitude`` is ``S``: the
    sum of the absolute values of the terms of one reduction (bounded by
    ``terms · max|term|``), i.e. the size of what is being accumulated, not
    of the result (a sum can cancel to ~0 while its rounding error stays
    ``eps · S``). ``depth`` counts chained reductions. ``rtol`` covers results
    far larger than their terms' rounding (products, not sums). ``output``:
    a narrower dtype the result is stored in (one more ulp, relative).
    """
    if terms < 1 or depth < 1:
        raise ValueError(f"terms and depth must be >= 1, got {terms}, {depth}")
    bound = SAFETY * eps_of(dtype) * math.sqrt(terms) * depth
    atol = bound * max(float(magnitude), 0.0)
    if output is None:
        return {"atol": atol, "rtol": bound}
    # Each side rounds by half an ulp of its own value: (eps/2)(|a| + |b|)
    # <= eps·|b| + (eps/2)|a - b|, and |b| exceeds the stored |expected| by
    # at most a half ulp more.
    out = eps_of(output)
    return {"atol": atol * (1 + out), "rtol": bound + out * (1 + out)}


def random_sum_size(terms: int, rms: float, sigmas: float = 6.0) -> float:
    """``magnitude`` of a sum of ``terms`` independent zero-mean terms of
    root-mean-square ``rms``: ``sigmas`` standard deviations of its longest
    partial sum, which bounds every partial sum of any order."""
    return sigmas * math.sqrt(max(1, terms)) * float(rms)


def sum_slack(
    terms: int, magnitude: float, dtype: torch.dtype | np.dtype | type = np.float64
) -> float:
    """Absolute slack of a (float64) sum of ``terms`` terms of absolute sum
    ``magnitude`` compared with a bound computed another way."""
    return reduction_tol(dtype, max(1, terms), magnitude)["atol"]


def steps_tol(
    dtype: torch.dtype | np.dtype | type,
    terms: int,
    magnitude: float,
    steps: int,
    depth: int = 1,
) -> dict[str, float]:
    """Tolerance of a value after ``steps`` training steps of two runs whose
    steps differ in the order of their reductions.

    Each step chains ``depth`` reductions of ``terms`` terms; ``magnitude`` is
    what one step's rounding is relative to, carried into the compared value:
    for a parameter, the largest step the optimizer takes when its gradient's
    terms share a sign per element, so that the gradient's error is relative
    (``lr·|g|`` for SGD, ``lr·sqrt(dim)`` for row-wise Adagrad,
    ``lr·adam_step_bound`` for Adam; an update divided by a root of the
    squared gradient doubles its relative error: ``depth`` 2), else ``lr``
    times the gain of the update times the gradient's ``S``. ``atol`` adds up
    over the steps; ``rtol`` covers the compared values' own rounding,
    ``depth`` times a step.
    """
    steps = max(1, steps)
    tol = reduction_tol(dtype, terms, magnitude, depth * steps)
    return {"atol": tol["atol"], "rtol": SAFETY * eps_of(dtype) * depth * steps}


def adam_step_bound(beta1: float, beta2: float, step: int) -> float:
    """Largest ``|m̂ / sqrt(v̂)|`` Adam can reach at ``step`` (1-based), any gradients.

    Cauchy-Schwarz on ``m = (1-β1)·Σ β1^i g_i`` against
    ``v = (1-β2)·Σ β2^i g_i²``, with the bias corrections; 1 at step 1.
    """
    ratio = beta1 * beta1 / beta2
    geometric = sum(ratio**i for i in range(step))
    corrected = (1 - beta1) / (1 - beta1**step) * math.sqrt((1 - beta2**step) / (1 - beta2))
    return corrected * math.sqrt(geometric)


def adam_drift(
    lr: float | Sequence[float], steps: int, betas: tuple[float, float] = (0.9, 0.999)
) -> float:
    """How far one Adam parameter of two runs may part in ``steps`` steps when
    its gradient is within rounding of zero: twice the largest step, each step.

    ``lr``: the learning rate, or one per step (warm-up schedules).
    """
    lrs = [float(lr)] * steps if isinstance(lr, (int, float)) else [float(x) for x in lr]
    if len(lrs) != steps:
        raise ValueError(f"need {steps} learning rates, got {len(lrs)}")
    return sum(2 * a * adam_step_bound(*betas, t) for t, a in enumerate(lrs, start=1))


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
    output: torch.dtype | None = None,
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
    tol = reduction_tol(dtype, max(1, terms), magnitude, depth, output=output)
    torch.testing.assert_close(actual, expected, **tol, **kwargs)


def assert_within(actual: Any, expected: Any, atol: Any, rtol: float = 0.0, what: str = "") -> None:
    """``|actual - expected| <= atol + rtol·|expected|`` elementwise, where
    ``atol`` may differ per element (per-coefficient bounds of `lstsq_tol`,
    `regression_tol`)."""
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    limit = np.broadcast_to(np.asarray(atol, dtype=np.float64), e.shape) + rtol * np.abs(e)
    err = np.abs(a - e)
    bad = ~(err <= limit)
    if bad.any():
        i = np.unravel_index(int(np.argmax(np.where(bad, err - limit, -np.inf))), e.shape)
        raise AssertionError(
            f"{what or 'values'}: {int(bad.sum())} of {e.size} outside their bound; "
            f"at {tuple(int(k) for k in i)}: {a[i]!r} vs {e[i]!r}, |diff| {err[i]:.3g} > "
            f"{limit[i]:.3g}"
        )


def _scaled(design: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(design, dtype=np.float64)
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0
    return a / scale, scale


def lstsq_tol(
    design: np.ndarray,
    solution: np.ndarray,
    target: np.ndarray | None = None,
    ridge: float = 0.0,
) -> np.ndarray:
    """Per-coefficient ``atol`` of a QR/SVD least-squares ``solution`` of
    ``design`` (fitted on unit-norm columns) against the exact one.

    ``target``: the right-hand side, for the residual term (omit it for data
    that the solution fits exactly up to rounding). ``ridge``: a Tikhonov
    term ``ridge·‖z‖²`` on the unit-norm columns (as `CostModel` adds), which
    moves the solution by up to ``ridge / σ_min² · ‖z‖``.
    """
    b, scale = _scaled(design)
    z = np.asarray(solution, dtype=np.float64) * scale
    m, n = b.shape
    singular = np.linalg.svd(b, compute_uv=False)
    kappa = float(singular[0] / singular[-1])
    z_norm = float(np.linalg.norm(z))
    residual = 0.0 if target is None else float(np.linalg.norm(b @ z - np.asarray(target)))
    ratio = residual / (float(singular[0]) * z_norm) if z_norm else 0.0
    eta = SAFETY * eps_of(np.float64) * math.sqrt(m * n)
    moved = eta * kappa * (2 + (kappa + 1) * ratio) * z_norm
    moved += ridge / float(singular[-1]) ** 2 * z_norm
    return moved / scale


def regression_tol(design: np.ndarray, residuals: np.ndarray, sigmas: float = 5.0) -> np.ndarray:
    """Half-widths of ``sigmas``-sigma intervals of least-squares coefficients
    fitted to noisy data: the sandwich ``(AᵀA)⁻¹ Aᵀ diag(r²) A (AᵀA)⁻¹`` (HC0,
    right for noise whose size varies with the point, as multiplicative
    jitter does), ``r`` the noise (or the fit's residuals)."""
    b, scale = _scaled(design)
    r = np.asarray(residuals, dtype=np.float64).reshape(-1)
    bread = np.linalg.pinv(b.T @ b)
    meat = b.T @ (b * (r * r)[:, None])
    var = np.diag(bread @ meat @ bread)
    return sigmas * np.sqrt(np.maximum(var, 0.0)) / scale


def sampling_tol(values: np.ndarray, sigmas: float = 5.0, other: np.ndarray | None = None) -> float:
    """Half-width of a ``sigmas``-sigma interval of the mean of ``values``
    (per column when 2-D: the widest), or of the difference of the means of
    ``values`` and ``other`` (independent draws)."""
    var = _mean_variance(values)
    if other is not None:
        var = var + _mean_variance(other)
    return float(sigmas * np.sqrt(var).max())


def _mean_variance(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
    return v.var(axis=0, ddof=1) / v.shape[0]


def std_tol(values: np.ndarray, sigmas: float = 5.0, other: np.ndarray | None = None) -> float:
    """Like `sampling_tol`, for the standard deviation of ``values``:
    ``se(s) ≈ sqrt((μ4 - σ⁴) / (4σ²n))``, which for normal draws is
    ``σ / sqrt(2n)``; with ``other``, of the difference of the two."""
    var = _std_variance(values)
    if other is not None:
        var = var + _std_variance(other)
    return float(sigmas * np.sqrt(var).max())


def _std_variance(values: np.ndarray) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
    centred = v - v.mean(axis=0)
    var = (centred**2).mean(axis=0)
    fourth = (centred**4).mean(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = (fourth - var * var) / (4 * var * v.shape[0])
    return np.where(var > 0, out, 0.0)
