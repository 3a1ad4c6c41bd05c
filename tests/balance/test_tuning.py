"""`AutoTune` (VBS shares from measured times) and `CostModel` (online fit)."""

import itertools

import numpy as np
import pytest
import torch

from freescale.balance import (
    VBS,
    AutoTune,
    AutoTuneConfig,
    CostModel,
    CostModelConfig,
    RuntimeInfo,
    WorldLengths,
    idle_fraction,
    rank_loads,
    sample_features,
)
from freescale.testing.tolerance import assert_within, lstsq_tol

pytestmark = pytest.mark.numeric


def test_autotune_moves_shares_against_the_time_difference():
    tune = AutoTune(4)
    assert tune.shares == (0.25,) * 4
    assert tune.update([10.0, 10.0, 10.0, 10.0]) == (0.25,) * 4
    shares = tune.update([20.0, 10.0, 10.0, 0.0])
    assert sum(shares) == pytest.approx(1.0)
    assert shares[0] < 0.25 < shares[3] and shares[1] == shares[2]
    tune.reset()
    assert tune.shares == (0.25,) * 4
    assert tune.update([0.0] * 4) == (0.25,) * 4  # nothing measured: nothing learnt


def test_autotune_respects_the_floor_and_the_step_cap():
    tune = AutoTune(2, AutoTuneConfig(gain=1.0, max_change=0.5, min_share=0.5))
    for _ in range(20):
        shares = tune.update([100.0, 1.0])
    assert shares[0] == pytest.approx(0.5 / 2) and sum(shares) == pytest.approx(1.0)
    first = AutoTune(2, AutoTuneConfig(gain=1.0, max_change=0.1)).update([100.0, 1.0])
    assert first[0] == pytest.approx(0.5 * 0.9 / (0.5 * 0.9 + 0.5 * 1.1))


@pytest.mark.parametrize(
    "bad", [dict(gain=0.0), dict(gain=1.5), dict(max_change=1.0), dict(min_share=0.0)]
)
def test_autotune_config_is_validated(bad):
    with pytest.raises(ValueError):
        AutoTuneConfig(**bad)


def test_autotune_rejects_bad_times():
    tune = AutoTune(2)
    for times in ([1.0], [1.0, float("nan")], [-1.0, 2.0]):
        with pytest.raises(ValueError):
            tune.update(times)


def test_autotune_with_vbs_equalizes_a_slow_rank():
    """Closed loop: rank 1 runs at half speed. Time = its VBS weight x speed
    factor, fed back with a one-step delay as in the pipeline; idle shrinks."""
    g = torch.Generator().manual_seed(0)
    uih = torch.randint(100, 5000, (256,), generator=g)
    world = WorldLengths(
        (64,) * 4, uih, torch.zeros(256, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    )
    slow = torch.tensor([1.0, 2.0, 1.0, 1.0], dtype=torch.float64)
    tune, vbs, pending, idle = AutoTune(4), VBS(alpha=1.0), [], []
    for _ in range(40):
        shares = tune.shares
        plan = vbs(world, RuntimeInfo(shares=shares))
        loads = rank_loads(plan, uih.double())
        times = loads * slow
        idle.append(idle_fraction(times))
        pending.append(times.tolist())
        if len(pending) > 1:
            tune.update(pending.pop(0))
    assert idle[0] > 0.15 and max(idle[-5:]) < 0.03
    # The last plan's shares are those that equalize the times (rank 1 half
    # of rank 0's) up to what the plan leaves: the times' spread r around
    # their mean, and whole samples (each rank's load is its share of the
    # total within one largest sample).
    r = float((times - times.mean()).abs().max() / times.mean())
    grain = float(uih.max()) / float(loads[:2].min())
    assert shares[1] == pytest.approx(0.5 * shares[0], rel=2 * (r + grain))


def _random_rank_features(rng: np.random.Generator, w: int) -> np.ndarray:
    n = rng.integers(1, 20, size=w).astype(float)
    L = rng.integers(100, 3000, size=w) * n
    return np.stack(
        [
            n,
            L,
            L * rng.uniform(500, 3000, size=w),
            n * rng.uniform(0, 4, size=w),
            7 * n * rng.uniform(0.5, 2, size=w),
        ],
        1,
    )


def test_cost_model_recovers_true_coefficients():
    rng = np.random.default_rng(1)
    true = np.array([0.2, 1e-3, 2e-7, 0.05, 1e-3])
    model = CostModel(CostModelConfig(window=8, min_steps=2, ridge=0.0))
    assert not model.fitted and model.coefficients == (0.0, 1.0, 0.0, 0.0, 0.0)
    for _ in range(8):
        feats = _random_rank_features(rng, 4)
        model.observe(torch.from_numpy(feats), (5.0 + feats @ true).tolist())
    assert model.fitted
    # Exact data: the fit (lstsq on unit-norm columns) is off by rounding only.
    feats = np.concatenate([f for f, _ in model._rows])
    times = np.concatenate([t for _, t in model._rows])
    design = np.concatenate([np.ones((len(times), 1)), feats], axis=1)
    exact = np.array([5.0, *true])
    assert_within((model.intercept, *model.coefficients), exact, lstsq_tol(design, exact, times))
    sample = torch.tensor([[1.0, 100.0, 1e4, 2.0, 5.0]])
    assert float(model.predict(sample)) == pytest.approx(float((sample.double().numpy() @ true)[0]))


def test_cost_model_keeps_coefficients_non_negative_and_forgets_old_steps():
    rng = np.random.default_rng(2)
    model = CostModel(CostModelConfig(window=6, min_steps=3))
    for _ in range(6):  # times fall with candidates: that column must be dropped, not negated
        feats = _random_rank_features(rng, 8)
        model.observe(feats, (1e-3 * feats[:, 1] - 1e-2 * feats[:, 3] + 50).tolist())
    assert min(model.coefficients) >= 0.0 and model.coefficients[3] == 0.0
    # the other columns are refit without it: the best non-negative fit, by brute force
    feats = np.concatenate([f for f, _ in model._rows])
    times = np.concatenate([t for _, t in model._rows])
    design = np.concatenate([np.ones((len(times), 1)), feats], axis=1)
    best, best_err = None, np.inf
    for mask in itertools.product([0, 1], repeat=6):
        cols = [j for j in range(6) if mask[j]]
        coef = np.linalg.lstsq(design[:, cols], times, rcond=None)[0] if cols else np.zeros(0)
        err = np.linalg.norm(design[:, cols] @ coef - times)
        if (coef >= 0).all() and err < best_err:
            best, best_err = np.zeros(6), err
            best[cols] = coef
    # The model's fit adds its ridge (relative 1e-9 by default) to the same
    # active columns; both are off by rounding.
    ridge, active = model.config.ridge, best > 0
    tol = np.zeros(6)
    tol[active] = lstsq_tol(design[:, active], best[active], times, ridge=ridge)
    assert_within((model.intercept, *model.coefficients), best, tol)
    new = np.array([0.0, 0.0, 1e-6, 0.0, 0.0])
    for _ in range(6):  # the window slides: the old model is forgotten
        feats = _random_rank_features(rng, 8)
        model.observe(feats, (feats @ new).tolist())
    feats = np.concatenate([f for f, _ in model._rows])
    design = np.concatenate([np.ones((len(feats), 1)), feats], axis=1)
    exact = np.array([0.0, *new])
    tol = lstsq_tol(design, exact, design @ exact, ridge=ridge)
    assert_within((model.intercept, *model.coefficients), exact, tol)


def test_cost_model_validates_observations_and_config():
    model = CostModel()
    with pytest.raises(ValueError):
        model.observe(torch.zeros(2, 4), [1.0, 2.0])
    with pytest.raises(ValueError):
        model.observe(torch.zeros(2, 5), [1.0])
    with pytest.raises(ValueError):
        model.observe(torch.zeros(2, 5), [1.0, float("inf")])
    with pytest.raises(ValueError):
        model.predict(torch.zeros(3, 4))
    for bad in (
        dict(window=0),
        dict(min_steps=40),
        dict(prior=(1.0,)),
        dict(prior=(0.0,) * 5),
        dict(ridge=2.0),
    ):
        with pytest.raises(ValueError):
            CostModelConfig(**bad)


def test_cost_model_predicts_identically_for_features_from_a_world():
    world = WorldLengths(
        (3,), torch.tensor([1, 2, 3]), torch.tensor([1, 0, 2]), torch.tensor([4, 5, 6])
    )
    model = CostModel(CostModelConfig(prior=(1.0, 2.0, 3.0, 4.0, 5.0)))
    got = model.predict(sample_features(world)).tolist()
    assert got == [1 + 2 + 3 + 4 + 5 * 4, 1 + 4 + 12, 1 + 6 + 27 + 8 + 5 * 11]
