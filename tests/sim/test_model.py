"""Compute model, fit and workload features of the simulator."""

import numpy as np
import pytest
import torch

from freescale.balance.world import FEATURES as BALANCE_FEATURES
from freescale.balance.world import WorldLengths, sample_features
from freescale.sim import FEATURES, ComputeModel, LengthSpec, fit_compute_model, rank_features
from freescale.sim.workload import synthetic_features, synthetic_step
from freescale.testing.tolerance import assert_within, lstsq_tol, sampling_tol, std_tol

pytestmark = pytest.mark.numeric


def random_features(rng, n):
    samples = rng.integers(16, 257, n).astype(float)
    uih = samples * rng.uniform(1000, 8000, n)
    uih_sq = uih * rng.uniform(1000, 17000, n)
    cand = samples * rng.uniform(1, 8, n)
    content = cand * rng.uniform(0, 4, n)
    return np.stack([samples, uih, uih_sq, cand, content], axis=1)


def _coefficients(model: ComputeModel) -> np.ndarray:
    return np.array([getattr(model, name) for name in "asbcde"])


def test_fit_recovers_known_coefficients_to_rounding():
    rng = np.random.default_rng(0)
    x = random_features(rng, 400)
    true = ComputeModel(a=15.6, s=0.12, b=7.4e-5, c=2.1e-8, d=0.01, e=0.005)
    y = true.predict(x)
    fit = fit_compute_model(x, y)
    design = np.concatenate([np.ones((len(x), 1)), x], axis=1)
    tol = lstsq_tol(design, _coefficients(true), y)
    assert_within(_coefficients(fit), _coefficients(true), tol)


def test_fit_is_non_negative_and_beats_zero():
    rng = np.random.default_rng(1)
    x = random_features(rng, 200)
    y = 5.0 + 2e-8 * x[:, 2] - 1e-4 * x[:, 1] + rng.normal(0, 0.1, 200)  # negative truth
    fit = fit_compute_model(x, y)
    assert min(fit.a, fit.s, fit.b, fit.c, fit.d, fit.e) >= 0.0
    assert np.mean((fit.predict(x) - y) ** 2) < np.mean((y - y.mean()) ** 2)
    no_a = fit_compute_model(x, 3e-8 * x[:, 2], intercept=False)
    exact = np.array([0.0, 0.0, 3e-8, 0.0, 0.0])
    assert no_a.a == 0.0
    assert_within(_coefficients(no_a)[1:], exact, lstsq_tol(x, exact, x @ exact))


def test_model_validates():
    with pytest.raises(ValueError):
        ComputeModel(a=-1.0, s=0, b=0, c=0, d=0, e=0)
    with pytest.raises(ValueError):
        fit_compute_model(np.zeros((3, 4)), np.zeros(3))


def test_features_match_the_balancers():
    assert FEATURES == BALANCE_FEATURES
    lengths = synthetic_step(LengthSpec(median=50, max_uih=80), np.random.default_rng(0), 3, 5)
    world = WorldLengths(
        lengths.batch_sizes,
        torch.from_numpy(lengths.uih),
        torch.from_numpy(lengths.num_candidates),
        torch.from_numpy(lengths.candidate_lengths),
    )
    per_sample = sample_features(world).numpy()
    expect = per_sample.reshape(3, 5, 5).sum(axis=1)
    np.testing.assert_allclose(rank_features(lengths), expect)
    dest = np.arange(15) % 3
    np.testing.assert_allclose(rank_features(lengths, dest).sum(0), per_sample.sum(0))
    assert lengths.uih.max() <= 80


def test_synthetic_features_with_assign():
    spec = LengthSpec(median=100, max_uih=200)
    calls = []

    def to_rank0(lengths, step):
        calls.append(step)
        return np.zeros(lengths.uih.size, dtype=np.int64)

    f = synthetic_features(spec, 3, 2, 4, seed=0, assign=to_rank0)
    assert calls == [0, 1, 2]
    np.testing.assert_allclose(f[:, 1], 0.0)
    np.testing.assert_allclose(f[:, 0, 0], 8.0)
    stay = synthetic_features(spec, 3, 2, 4, seed=0, assign=lambda lengths, step: None)
    np.testing.assert_allclose(stay.sum(axis=1), f.sum(axis=1))


def test_vectorized_unbalanced_features_match_the_per_step_draws_in_distribution():
    # Different random streams, same law: per-rank means and spreads agree.
    spec = LengthSpec(median=300, sigma=0.8, cap=900, max_uih=700, max_candidates=5, max_content=3)
    fast = synthetic_features(spec, 3000, 2, 16, seed=1)
    slow = synthetic_features(spec, 3000, 2, 16, seed=2, assign=lambda lengths, step: None)
    np.testing.assert_allclose(fast[..., 0], 16.0)
    # Per feature, 6000 independent (step, rank) draws each: means and spreads
    # agree within the sampling error the draws themselves show.
    fast, slow = fast.reshape(-1, fast.shape[-1]), slow.reshape(-1, slow.shape[-1])
    for j in range(1, fast.shape[1]):
        a, b = fast[:, j], slow[:, j]
        assert abs(a.mean() - b.mean()) <= sampling_tol(a, other=b), j
        assert abs(a.std() - b.std()) <= std_tol(a, other=b), j
    assert fast[:, 1].max() <= 16 * 700 and np.all(fast[:, 4] >= 0)
