"""The tolerance helper: reordered sums pass, real errors fail."""

import numpy as np
import pytest
import torch

from freescale.testing.tolerance import (
    abs_sum,
    adam_drift,
    adam_step_bound,
    assert_reordered_close,
    assert_within,
    eps_of,
    lstsq_tol,
    random_sum_size,
    reduction_tol,
    regression_tol,
    sampling_tol,
    std_tol,
    steps_tol,
    sum_slack,
)

pytestmark = pytest.mark.numeric


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 7, 1000, 100_000])
def test_two_orders_of_a_sum_are_within_the_bound(dtype, n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    perm = torch.randperm(n, generator=g)

    # Sequential accumulation in the working dtype: the worst ordinary order.
    def seq(v):
        acc = torch.zeros((), dtype=dtype)
        for chunk in v.split(max(1, n // 64)):
            acc = acc + chunk.sum()
        return acc

    a, b = seq(x), seq(x[perm])
    tol = reduction_tol(dtype, n, abs_sum(x))
    assert abs(float(a) - float(b)) <= tol["atol"]


def test_a_real_error_is_larger_than_the_bound():
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0))
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    good = x @ w
    bad = good.clone()
    bad[7, 9] += 1e-3 * good.abs().max()  # one element off by 0.1 % of the scale
    assert_reordered_close((x.double() @ w.double()).float(), good, terms=64)
    with pytest.raises(AssertionError):
        assert_reordered_close(bad, good, terms=64, magnitude=abs_sum(x[7]) * 3)


def test_bound_scales_with_dtype_length_and_depth():
    t = reduction_tol(torch.float32, 100, 2.0)
    assert t["rtol"] == pytest.approx(4 * eps_of(torch.float32) * 10)
    assert t["atol"] == pytest.approx(2.0 * t["rtol"])
    assert reduction_tol(torch.float32, 100, 2.0, depth=3)["atol"] == pytest.approx(3 * t["atol"])
    assert reduction_tol(torch.float64, 100, 2.0)["atol"] < t["atol"]
    with pytest.raises(ValueError):
        reduction_tol(torch.float32, 0, 1.0)


def test_lstsq_tol_grows_with_conditioning():
    rng = np.random.default_rng(0)
    good = rng.normal(size=(50, 3))
    bad = good.copy()
    bad[:, 2] = bad[:, 1] + 1e-6 * rng.normal(size=50)
    x = np.ones(3)
    assert lstsq_tol(bad, x).max() > 1e5 * lstsq_tol(good, x).max()


def test_lstsq_tol_covers_a_badly_scaled_exact_fit():
    """Columns of 1 to 1e7 (the cost models' features), fitted on unit-norm
    columns as the fits do: the recovered coefficients are within the bound."""
    rng = np.random.default_rng(1)
    design = np.stack([np.ones(40), rng.uniform(1e2, 1e3, 40), rng.uniform(1e6, 1e7, 40)], 1)
    truth = np.array([5.0, 1e-3, 2e-8])
    target = design @ truth
    scale = np.linalg.norm(design, axis=0)
    fit = np.linalg.lstsq(design / scale, target, rcond=None)[0] / scale
    tol = lstsq_tol(design, truth, target)
    assert_within(fit, truth, tol)
    assert (tol < 1e-9 * np.abs(truth)).all()  # rounding, not a loose literal


def test_regression_tol_is_the_spread_of_refits():
    rng = np.random.default_rng(2)
    design = np.stack([np.ones(60), rng.uniform(1, 10, 60)], 1)
    truth = np.array([2.0, 0.5])
    fits, widths = [], []
    for _ in range(400):
        noise = (design @ truth) * 0.1 * rng.standard_normal(60)  # multiplicative
        fits.append(np.linalg.lstsq(design, design @ truth + noise, rcond=None)[0])
        widths.append(regression_tol(design, noise, sigmas=1.0))
    spread, width = np.std(fits, axis=0), np.mean(widths, axis=0)
    np.testing.assert_array_less(np.abs(spread / width - 1), 0.2)


def test_sampling_and_std_tol_are_standard_errors():
    v = np.array([1.0, 3.0] * 50)
    assert sampling_tol(v, sigmas=1) == pytest.approx(np.std(v, ddof=1) / 10)
    assert sampling_tol(v, sigmas=1, other=v) == pytest.approx(np.sqrt(2) * np.std(v, ddof=1) / 10)
    normal = np.random.default_rng(3).normal(0, 2.0, 100_000)
    assert std_tol(normal, sigmas=1) == pytest.approx(2.0 / np.sqrt(2 * normal.size), rel=0.05)
    assert std_tol(normal, sigmas=1, other=normal) == pytest.approx(
        np.sqrt(2) * std_tol(normal, sigmas=1)
    )


def test_sum_slack_and_steps_tol_are_the_reduction_bound():
    assert sum_slack(9, 2.0) == reduction_tol(np.float64, 9, 2.0)["atol"]
    assert sum_slack(0, 2.0) == reduction_tol(np.float64, 1, 2.0)["atol"]
    tol = steps_tol(torch.float32, 50, 1.0, steps=10, depth=3)
    assert tol["atol"] == reduction_tol(torch.float32, 50, 1.0, depth=30)["atol"]
    assert tol["rtol"] == pytest.approx(4 * eps_of(torch.float32) * 30)


def test_output_rounding_adds_one_ulp():
    x = torch.randn(3000, 16, generator=torch.Generator().manual_seed(4)).bfloat16()
    a = x.float().sum(0).bfloat16()  # fp32 sums stored as bf16
    b = x.float().flip(0).cumsum(0)[-1].bfloat16()
    tol = reduction_tol(torch.float32, 3000, abs_sum(x[:, 0]) * 2, output=torch.bfloat16)
    ulp = eps_of(torch.bfloat16)
    assert tol["rtol"] == reduction_tol(torch.float32, 3000, 1.0)["rtol"] + ulp * (1 + ulp)
    torch.testing.assert_close(a, b, **tol)


def test_adam_step_bound_and_drift():
    assert adam_step_bound(0.9, 0.999, 1) == pytest.approx(1.0)
    rng = np.random.default_rng(5)
    for _ in range(200):  # spiky gradients: |m̂/sqrt(v̂)| stays under the bound
        steps = int(rng.integers(1, 30))
        g = rng.standard_normal(steps) * np.exp(4 * rng.standard_normal(steps))
        m = v = 0.0
        for t in range(1, steps + 1):
            m, v = 0.9 * m + 0.1 * g[t - 1], 0.999 * v + 0.001 * g[t - 1] ** 2
            ratio = abs(m / (1 - 0.9**t)) / np.sqrt(v / (1 - 0.999**t))
            assert ratio <= adam_step_bound(0.9, 0.999, t) * (1 + 1e-12)
    # Gradients within rounding of zero, of opposite signs in two runs: the
    # parameters part by twice a step each step, within the drift.
    params = [torch.zeros(1, requires_grad=True) for _ in range(2)]
    opts = [torch.optim.Adam([p], lr=1e-3) for p in params]
    for _ in range(6):
        for sign, p, opt in zip((1, -1), params, opts, strict=True):
            p.grad = torch.full((1,), sign * 1e-5)  # noise, yet far above Adam's eps
            opt.step()
    gap = float((params[0] - params[1]).abs().detach())
    assert 0.9 * 2 * 6 * 1e-3 < gap <= adam_drift(1e-3, 6)
    assert adam_drift([1e-3, 2e-3], 2) > adam_drift(1e-3, 2)
    with pytest.raises(ValueError):
        adam_drift([1e-3], 2)


def test_assert_within_takes_one_bound_per_element():
    assert_within([1.0, 2.0], [1.1, 2.0], np.array([0.2, 0.0]))
    with pytest.raises(AssertionError, match="1 of 2"):
        assert_within([1.0, 2.0], [1.1, 2.0], np.array([0.01, 0.5]))


def test_random_sum_size_bounds_the_partial_sums_of_random_terms():
    x = torch.randn(200_000, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    size = random_sum_size(x.numel(), float(x.pow(2).mean().sqrt()))
    assert float(x.cumsum(0).abs().max()) <= size < abs_sum(x) / 50
    a, b = x.float().sum(), x.float().flip(0).cumsum(0)[-1]  # blocked vs sequential
    assert abs(float(a) - float(b)) <= reduction_tol(torch.float32, x.numel(), size)["atol"]
