"""Calibration fit on synthetic data with known coefficients (freescale.sim.calibrate)."""

import json

import numpy as np
import pytest

from freescale.sim import ComputeModel, LinkModel, SimConfig, simulate
from freescale.sim.calibrate import (
    Calibration,
    MeasuredRun,
    fit_compute,
    fit_link,
    fit_runs,
    link_from_bandwidth,
    read_bandwidth_tables,
    read_steps,
)
from freescale.sim.timeline import CATEGORIES, alltoall_ms
from freescale.testing.tolerance import assert_within, lstsq_tol, regression_tol, std_tol

pytestmark = pytest.mark.numeric

TRUE = ComputeModel(a=13.0, s=0.1, b=8e-5, c=2e-8, d=0.02, e=0.004, jitter_sigma=0.03)


def features(rng, steps, w, b=128):
    uih = np.exp(np.log(4500) + 0.55 * rng.standard_normal((steps, w, b))).clip(0, 17000)
    ncand = rng.integers(1, 9, (steps, w, b))
    content = rng.integers(0, 5 * ncand + 1)  # any per-sample count; summed below
    cols = [np.full((steps, w), float(b)), uih.sum(2), (uih**2).sum(2), ncand.sum(2),
            content.sum(2).astype(float)]  # fmt: skip
    return np.stack(cols, axis=-1)


def coefficients(model: ComputeModel) -> np.ndarray:
    return np.array([getattr(model, name) for name in "asbcde"])


def assert_fit_within_sampling_error(fit: ComputeModel, x: np.ndarray, y: np.ndarray) -> None:
    """Coefficients, predictions and jitter of a fit to ``y`` (TRUE's times
    with jitter) within five standard errors of the noise actually drawn."""
    x = x.reshape(-1, x.shape[-1])
    y, mean = y.reshape(-1), TRUE.predict(x).reshape(-1)
    design = np.concatenate([np.ones((len(x), 1)), x], axis=1)
    tol = regression_tol(design, y - mean)
    assert_within(coefficients(fit), coefficients(TRUE), tol, what="coefficients")
    # A prediction moves by at most the coefficients' bounds times the features.
    assert_within(fit.predict(x), mean, np.abs(design) @ tol, what="predictions")
    # σ of log(y / fit) vs σ of log(y / truth): their sampling error, plus
    # what the fitted predictions change in each log ratio.
    drawn = np.log(y / mean)
    moved = np.sqrt(np.mean(np.log(fit.predict(x) / mean) ** 2))
    assert abs(fit.jitter_sigma - TRUE.jitter_sigma) <= std_tol(drawn) + moved


def test_fit_compute_recovers_coefficients_and_jitter():
    rng = np.random.default_rng(0)
    x = features(rng, 400, 4, b=int(rng.integers(16, 129)))
    x = np.concatenate([x, features(rng, 400, 4, b=32)])  # two batch sizes: s and a separable
    y = TRUE.sample(x, np.random.default_rng(1))
    assert_fit_within_sampling_error(fit_compute(x, y), x, y)
    # without noise the fit is exact up to rounding
    y = TRUE.predict(x)
    exact = fit_compute(x, y)
    flat = x.reshape(-1, x.shape[-1])
    design = np.concatenate([np.ones((len(flat), 1)), flat], axis=1)
    tol = lstsq_tol(design, coefficients(TRUE), y.reshape(-1))
    assert_within(coefficients(exact), coefficients(TRUE), tol)
    # each log ratio is then off by the predictions' bound, relative
    ratio_bound = float(np.max((np.abs(design) @ tol) / y.reshape(-1)))
    assert exact.jitter_sigma <= ratio_bound


def test_fit_compute_rejects_bad_input():
    with pytest.raises(ValueError, match="points"):
        fit_compute(np.ones((3, 5)), np.ones(3))
    with pytest.raises(ValueError, match="> 0"):
        fit_compute(np.ones((10, 5)), np.zeros(10))


def test_fit_link_recovers_alpha_beta_and_clamps_negative():
    mb = np.array([1.0, 4.0, 16.0, 64.0])
    link = fit_link(mb, 0.5 + 0.08 * mb)
    assert link.alpha_ms == pytest.approx(0.5) and link.beta_ms_per_mb == pytest.approx(0.08)
    # falling times would need beta < 0: the fit keeps beta = 0, alpha the mean
    flat = fit_link(np.array([1.0, 2.0]), np.array([2.0, 1.0]))
    assert flat.beta_ms_per_mb == 0.0 and flat.alpha_ms == pytest.approx(1.5)


REPORT = """# Communicator bandwidth

## all_to_all: latency us / bandwidth GB/s (received from peers, per rank)

| bytes per rank | smfree-shm | smfree-gloo |
|---|---|---|
| 64 KiB | 508 / 0.06 | 587 / 0.06 |
| 1 MiB | 1000 / 0.98 | 2000 / 0.51 |
| 4 MiB | 1300 / 3.76 | 5000 / 1.26 |
| 16 MiB | 2500 / 8.14 | 17000 / 2.15 |
"""


def test_bandwidth_report_parsed_and_fitted():
    tables = read_bandwidth_tables(REPORT)
    assert tables[("all_to_all", "smfree-shm")][0] == pytest.approx((65536 / 1e6, 0.508))
    link = link_from_bandwidth(REPORT, "all_to_all", "smfree-shm")
    mb = np.array([1, 4, 16]) * (1 << 20) / 1e6
    expect = fit_link(mb, np.array([1.0, 1.3, 2.5]))
    assert link == expect and link.beta_ms_per_mb > 0
    with pytest.raises(ValueError, match="no all_gather"):
        link_from_bandwidth(REPORT, "all_gather", "smfree-shm")


def cal_points_mb(runs: list[MeasuredRun], id_bytes: int = 8, row_bytes: int = 1024) -> list:
    """The MB points of the link fit: the slowest rank's volume per step
    (`alltoall_ms` at α = 0, β = 1), averaged, ids then rows, per W > 1 run."""
    unit = SimConfig(intra=LinkModel(0.0, 1.0), inter=LinkModel(0.0, 1.0))
    out = []
    for r in runs:
        if r.world_size > 1:
            ids = r.features[..., 1] + r.features[..., 3] + r.features[..., 4]
            out += [float(alltoall_ms(ids, n, unit).mean()) for n in (id_bytes, row_bytes)]
    return out


def step_lines(feats, compute, exposed):
    return [{"step": i, "compute_ms": compute[i].tolist(), "exposed_comm_ms": exposed,
             "rank_features": feats[i].tolist(), "step_ms": 1.0, "items": 1}
            for i in range(len(feats))]  # fmt: skip


def test_fit_runs_from_simulated_logs_recovers_link_and_fixed_parts():
    """Logs produced by the simulator itself with known parameters: the fit
    gives them back (compute, fixed W = 1 exposure, the intra link)."""
    rng = np.random.default_rng(3)
    intra = LinkModel(0.3, 0.004)
    fixed = {"ids": 0.2, "emb": 0.7, "grad": 0.7, "dense": 0.1, "meta": 0.0}
    runs, feats, times = [], [], []
    for w, b in ((1, 128), (2, 128), (2, 64), (4, 32)):
        f = features(rng, 30, w, b)
        cfg = SimConfig(intra=intra, embedding_dim=256, embedding_bytes=4, fixed_ms=fixed)
        out = simulate(f, TRUE, cfg, seed=w * b)
        exposed = {"ids_a2a": float(out.exposed_ms["ids"].mean()),
                   "emb_a2a": float(out.exposed_ms["emb"].mean())}  # fmt: skip
        runs.append(MeasuredRun(step_lines(f, out.compute_ms, exposed), f))
        feats.append(f.reshape(-1, f.shape[-1]))
        times.append(out.compute_ms.reshape(-1))
    cal = fit_runs(runs, LinkModel(0.02, 0.04), row_bytes=1024)
    assert_fit_within_sampling_error(cal.compute, np.concatenate(feats), np.concatenate(times))
    assert cal.fixed_ms["ids"] == pytest.approx(0.2) and cal.fixed_ms["emb"] == pytest.approx(0.7)
    # The sync exchanges are exposed whole: their mean is alpha + beta x the
    # mean MB, a line the link fit goes through up to rounding.
    mb = np.array(cal_points_mb(runs))
    exact = np.array([0.3, 0.004])
    design = np.stack([np.ones_like(mb), mb], axis=1)
    got = (cal.intra.alpha_ms, cal.intra.beta_ms_per_mb)
    assert_within(got, exact, lstsq_tol(design, exact, design @ exact))
    back = Calibration.from_json(cal.to_json())
    assert back == cal and set(back.fixed_ms) == set(CATEGORIES)


def test_read_steps_and_calibration_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0}\n')
    with pytest.raises(ValueError, match="compute_ms"):
        read_steps(bad)
    bad.write_text("not json\n")
    with pytest.raises(ValueError, match="not a JSON line"):
        read_steps(bad)
    with pytest.raises(ValueError, match="calibration"):
        Calibration.from_json(json.dumps({"compute": {}}))
