"""The tolerance helper: reordered sums pass, real errors fail."""

import numpy as np
import pytest
import torch

from freescale.testing.tolerance import (
    abs_sum,
    assert_reordered_close,
    eps_of,
    lstsq_tol,
    reduction_tol,
    sampling_tol,
)


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
    assert lstsq_tol(bad, 1.0)["rtol"] > 1e6 * lstsq_tol(good, 1.0)["rtol"]


def test_sampling_tol_is_the_standard_error():
    v = np.array([1.0, 3.0] * 50)
    assert sampling_tol(v, sigmas=1) == pytest.approx(np.std(v, ddof=1) / 10)
