"""Hand-computable cases of the simulator's step timeline (freescale.sim.timeline)."""

import numpy as np
import pytest

from freescale.sim import ComputeModel, LinkModel, SimConfig, simulate
from freescale.sim.timeline import allreduce_ms, alltoall_ms
from freescale.testing.tolerance import sampling_tol, std_tol, sum_slack

# compute_ms = samples column: lets a test set each rank's compute directly.
UNIT = ComputeModel(a=0.0, s=1.0, b=0.0, c=0.0, d=0.0, e=0.0)
FREE = LinkModel(0.0, 0.0)


def world(compute, uih=0.0, cand=0.0):
    """features[S, W, 5] with the given per-(step, rank) compute ms and ids."""
    compute = np.atleast_2d(np.asarray(compute, dtype=np.float64))
    f = np.zeros((*compute.shape, 5))
    f[..., 0] = compute
    f[..., 1] = uih
    f[..., 3] = cand
    return f


def test_two_ranks_no_comm_straggler_step_time_and_qps():
    out = simulate(world([100.0, 80.0], uih=1000, cand=10), UNIT, SimConfig(intra=FREE))
    assert out.step_ms[0] == pytest.approx(100.0)
    # mean over ranks of (max C - C_r) / T = (0 + 20) / 2 / 100
    assert out.straggler_pct[0] == pytest.approx(10.0)
    assert out.exposed_ms["grad"][0] == pytest.approx(10.0)  # fast rank waits 20, mean 10
    # items = (1000 + 10) * 2 ranks per 100 ms
    assert out.qps[0] == pytest.approx(2020 / 0.1)
    assert out.summary()["qps"] == pytest.approx(2020 / 0.1)
    np.testing.assert_allclose(out.compute_ms[0], [100.0, 80.0])


# Two ranks on one node, intra link alpha 1 ms, beta 2 ms/MB. Rank 0 looks up
# 100k ids, rank 1 50k: each sends half of its ids to the other and receives
# half of the other's, so both move max(50k, 25k) = 50k ids = 0.4 MB (8 B/id):
# X_ids = 1 + 2 * 0.4 = 1.8 ms; rows of 16 B: 0.8 MB, X_rows = 2.6 ms.
LINK = LinkModel(1.0, 2.0)
TWO = dict(intra=LINK, gpus_per_node=2, bytes_per_id=8, embedding_dim=4, embedding_bytes=4)


def test_alltoall_duration_by_arithmetic():
    ids = np.array([[100_000.0, 50_000.0]])
    assert alltoall_ms(ids, 8, SimConfig(**TWO))[0] == pytest.approx(1.8)
    assert alltoall_ms(ids, 16, SimConfig(**TWO))[0] == pytest.approx(2.6)


def test_alltoall_two_tiers():
    # W=4, 2 per node, 400k ids each: intra peer gets 1/4 (100k ids = 0.8 MB),
    # the two inter peers 2/4 (200k ids = 1.6 MB); tiers run concurrently.
    cfg = SimConfig(intra=LinkModel(1.0, 1.0), inter=LinkModel(0.5, 2.0), gpus_per_node=2)
    ids = np.full((1, 4), 400_000.0)
    assert alltoall_ms(ids, 8, cfg)[0] == pytest.approx(max(1.0 + 0.8, 0.5 + 2.0 * 1.6))


def test_sync_blocking_collectives_and_slowest_rank_waits_only_the_transfer():
    out = simulate(world([[100.0, 80.0]], uih=[[100_000, 50_000]]), UNIT, SimConfig(**TWO))
    assert out.step_ms[0] == pytest.approx(1.8 + 2.6 + 100.0 + 2.6)
    grad = out.rank_exposed_ms("grad")[0]
    assert grad[0] == pytest.approx(2.6)  # the slowest rank waits the transfer alone
    assert grad[1] == pytest.approx(2.6 + 20.0)
    assert out.exposed_ms["grad"][0] == pytest.approx(2.6 + 10.0)
    assert out.exposed_ms["ids"][0] == pytest.approx(1.8)
    assert out.exposed_ms["emb"][0] == pytest.approx(2.6)
    assert out.straggler_pct[0] == pytest.approx(100.0 * 10.0 / 107.0)
    # every rank's step = its compute + its exposed communication
    total = sum(out.rank_exposed_ms(c)[0] for c in ("ids", "emb", "grad", "dense"))
    np.testing.assert_allclose(out.compute_ms[0] + total, out.step_ms[0])


@pytest.mark.numeric
def test_sdd_hides_a_short_ids_exchange_and_exposes_the_excess():
    cfg = SimConfig(**{**TWO, "bytes_per_id": 80}, mode="sdd", forward_fraction=0.5)
    uih = [[100_000, 50_000]] * 2
    # X_ids = 1 + 2 * 4 MB = 9 ms. Long steps: window 0.5 * 100 + 2.6 = 52.6 > 9.
    long = simulate(world([[100.0, 80.0]] * 2, uih=uih), UNIT, cfg)
    np.testing.assert_allclose(long.exposed_ms["ids"], 0.0)
    np.testing.assert_allclose(long.step_ms, 2.6 + 100.0 + 2.6)
    # Short step 0 (window 0.5 * 4 + 2.6 = 4.6) then a long step 1: step i's ids
    # exchange runs in step i-1's window, so step 1 exposes 9 - 4.6 as well.
    mixed = simulate(world([[4.0, 2.0], [100.0, 80.0]], uih=uih), UNIT, cfg)
    np.testing.assert_allclose(mixed.exposed_ms["ids"], [4.4, 4.4])
    np.testing.assert_allclose(mixed.step_ms, [4.4 + 2.6 + 4.0 + 2.6, 4.4 + 2.6 + 100.0 + 2.6])
    sync = simulate(world([[4.0, 2.0], [100.0, 80.0]], uih=uih), UNIT, SimConfig(**TWO))
    slack = sum_slack(8, float(sync.step_ms.max()) + 9.0 + 4.4)  # a step: a few float64 sums
    assert np.all(mixed.step_ms <= sync.step_ms + 9.0 - 4.4 + slack)


@pytest.mark.parametrize("kappa", [0.0, 0.213, 1.0])
def test_freescale_blocks_only_the_collision_share(kappa):
    f = world([[100.0, 100.0]] * 3, uih=[[100_000, 50_000]] * 3)
    sync = simulate(f, UNIT, SimConfig(**TWO))
    fs = simulate(f, UNIT, SimConfig(**TWO, mode="freescale", collision_share=kappa))
    np.testing.assert_allclose(
        fs.exposed_ms["emb"] + fs.exposed_ms["grad"],
        kappa * (sync.exposed_ms["emb"] + sync.exposed_ms["grad"]),
    )
    np.testing.assert_allclose(fs.exposed_ms["ids"], 0.0)
    np.testing.assert_allclose(fs.step_ms, 100.0 + 2 * kappa * 2.6)


def test_freescale_prefetch_excess_lands_in_ids_then_emb():
    # window = (1 - 0.5) * 2 + 0.5 * 2.6 = 2.3; ids (1.8) hidden; private rows
    # 0.5 * 2.6 = 1.3 more: 1.8 + 1.3 - 2.3 = 0.8 exposed in emb.
    cfg = SimConfig(**TWO, mode="freescale", collision_share=0.5, forward_fraction=0.5)
    out = simulate(world([[2.0, 2.0]], uih=[[100_000, 50_000]]), UNIT, cfg)
    assert out.exposed_ms["ids"][0] == pytest.approx(0.0)
    assert out.exposed_ms["emb"][0] == pytest.approx(0.5 * 2.6 + 0.8)
    assert out.step_ms[0] == pytest.approx(0.8 + 1.3 + 2.0 + 1.3)


def test_dense_tail_and_single_rank():
    cfg = SimConfig(intra=LinkModel(1.0, 2.0), dense_mb=10.0, dense_tail=0.25, gpus_per_node=2)
    assert allreduce_ms(2, cfg) == pytest.approx(1.0 + 2.0 * 10.0)  # 2 (W-1)/W = 1
    out = simulate(world([[50.0, 50.0]]), UNIT, cfg)
    assert out.exposed_ms["dense"][0] == pytest.approx(0.25 * 21.0)
    one = simulate(world([[50.0]], uih=1e6), UNIT, cfg)
    assert one.step_ms[0] == pytest.approx(50.0)  # nothing leaves a lone rank
    assert one.straggler_pct[0] == 0.0


@pytest.mark.numeric
def test_jitter_is_seeded_and_mean_one():
    model = ComputeModel(a=10.0, s=0.0, b=0.0, c=0.0, d=0.0, e=0.0, jitter_sigma=0.2)
    f = world(np.zeros((2000, 4)))
    a = simulate(f, model, SimConfig(intra=FREE), seed=3)
    b = simulate(f, model, SimConfig(intra=FREE), seed=3)
    np.testing.assert_array_equal(a.compute_ms, b.compute_ms)
    draws = a.compute_ms.ravel()  # 8000 independent draws of 10 x a mean-one jitter
    assert abs(draws.mean() - 10.0) <= sampling_tol(draws)
    assert a.straggler_pct.mean() > 0  # jitter alone makes stragglers


def test_invalid_inputs_raise():
    with pytest.raises(ValueError, match="mode"):
        SimConfig(mode="async")
    with pytest.raises(ValueError, match="multiple"):
        simulate(world([[1.0] * 3]), UNIT, SimConfig(gpus_per_node=2))
    with pytest.raises(ValueError, match="features"):
        simulate(np.zeros((2, 5)), UNIT, SimConfig())
    with pytest.raises(ValueError, match="collision_share"):
        SimConfig(collision_share=1.5)


def test_forward_barrier_pays_each_phase_slowest_rank():
    # f = 0.5, no jitter: rank 0 computes 100 (fwd 50, bwd 50), rank 1 80 (40, 40);
    # phases share the slowest rank, so the step is still 100 + fixed; the fast
    # rank waits 10 at the forward barrier (meta) and 10 at the gradient AllToAll.
    cfg = SimConfig(intra=FREE, forward_fraction=0.5, forward_barrier=True)
    out = simulate(world([[100.0, 80.0]]), UNIT, cfg)
    assert out.step_ms[0] == pytest.approx(100.0)
    np.testing.assert_allclose(out.rank_exposed_ms("meta")[0], [0.0, 10.0])
    np.testing.assert_allclose(out.rank_exposed_ms("grad")[0], [0.0, 10.0])
    assert out.exposed_ms["meta"][0] == pytest.approx(5.0)
    assert out.straggler_pct[0] == pytest.approx(10.0)


@pytest.mark.numeric
def test_forward_barrier_with_jitter_costs_max_fwd_plus_max_bwd():
    model = ComputeModel(a=0.0, s=1.0, b=0.0, c=0.0, d=0.0, e=0.0, jitter_sigma=0.3)
    f = world(np.full((500, 4), 100.0))
    cfg = SimConfig(intra=FREE, forward_barrier=True)
    out = simulate(f, model, cfg, seed=5)
    # step = max fwd + max bwd >= max (fwd + bwd), strictly with independent draws
    slack = sum_slack(4, float(out.step_ms.max()))  # the two sides add in other orders
    assert np.all(out.step_ms >= out.compute_ms.max(axis=1) - slack)
    assert np.mean(out.step_ms > out.compute_ms.max(axis=1) + slack) > 0.5
    total = sum(out.rank_exposed_ms(c) for c in ("ids", "emb", "grad", "dense", "meta"))
    np.testing.assert_allclose(out.compute_ms + total, out.step_ms[:, None].repeat(4, axis=1))
    # the phase sigmas are scaled so the total's spread stays about sigma (to
    # first order): the draws' spread is that of the exact law of the total
    ratio = np.log(out.compute_ms / 100.0).ravel()
    assert abs(ratio.std() - _log_total_std(cfg.forward_fraction, 0.3)) <= std_tol(ratio)


def _log_total_std(f: float, sigma: float) -> float:
    """Standard deviation of ``log(f·J1 + (1-f)·J2)``, ``J`` independent
    mean-one lognormal jitters of the scaled sigma the forward barrier uses
    (Gauss-Hermite quadrature of order 80: exact to float64 here)."""
    s = sigma / np.sqrt(f * f + (1 - f) ** 2)
    x, w = np.polynomial.hermite_e.hermegauss(80)
    w = w / w.sum()
    j = np.exp(s * x - 0.5 * s * s)
    log_total = np.log(f * j[:, None] + (1 - f) * j[None, :])
    weight = w[:, None] * w[None, :]
    mean = (weight * log_total).sum()
    return float(np.sqrt((weight * (log_total - mean) ** 2).sum()))


def test_fixed_ms_adds_to_every_rank_and_the_step():
    cfg = SimConfig(intra=FREE, fixed_ms={"emb": 0.5, "meta": 1.5})
    out = simulate(world([[100.0, 80.0]]), UNIT, cfg)
    assert out.step_ms[0] == pytest.approx(102.0)
    assert out.exposed_ms["emb"][0] == pytest.approx(0.5)
    assert out.exposed_ms["meta"][0] == pytest.approx(1.5)
    assert out.exposed_ms["grad"][0] == pytest.approx(10.0)
    with pytest.raises(ValueError, match="fixed_ms"):
        SimConfig(fixed_ms={"bogus": 1.0})
    with pytest.raises(ValueError, match="fixed_ms"):
        SimConfig(fixed_ms={"ids": -1.0})
