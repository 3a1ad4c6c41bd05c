"""The step metrics blame the right cause (2 CPU ranks, injected delays).

Extra compute on one rank must appear as that rank's compute and as
straggler %; a slow loader on one rank must appear as its data wait and
leave straggler % near zero (its compute did not change). The step summary
itself is checked field by field on a hand-built table of unequal ranks.
"""

import json
import math
import statistics
from dataclasses import replace

import pytest
import torch

from freescale.config import build_config
from freescale.observe.metrics import RankStep, RunSummary, gather_step, summarize_step
from freescale.observe.timing import CATEGORIES
from freescale.run.launch import launch
from freescale.testing.tolerance import reduction_tol


# ---- the step summary on a hand-built table (no run, milliseconds) -------------
# Four ranks, unequal on purpose: the slowest step (rank 1) and the slowest
# compute (rank 2) are different ranks, so a mean taken for a max, or one
# column read for another, changes a number. Every value, and every partial sum
# of the summary's means and sums, is a small dyadic rational: exact in float64
# in any order, so those fields are compared with ``==`` (they are exact, not
# close). Only QPS and the FLOPs rates (divide by 0.08 s) and NE (logs) round;
# they get the tolerance of `freescale.testing.tolerance`.
def _rank(step, compute, data, exposed, bce, pos, cands, items, samples, part, coll, feats, flops):
    return RankStep(
        step_ms=step, compute_ms=compute, data_ms=data,
        exposed=dict(zip(CATEGORIES, exposed, strict=True)), bce_sum=bce, positives=pos,
        candidates=cands, items=items, samples=samples, collision_part_ms=part,
        collision=coll, features=feats, flops=flops,
    )  # fmt: skip


RANKS = [  # step, compute, data, exposed (CATEGORIES order), bce, pos, cands, items, samples,
    #        collision part, (C rows, rows next, C ids, ids next), features (FEATURES order),
    #        FLOPs of the rank's batch
    _rank(60, 16, 8, (2, 4, 1, 0.5, 0.25, 0.125), 3.5, 2, 8, 100, 4, 1.5, (1, 4, 2, 8),
          (4, 40, 400, 8, 16), 8e9),
    _rank(80, 36, 0, (0, 2, 3, 0.5, 0.25, 0.375), 1.0, 1, 4, 60, 3, 0.5, (0, 2, 0, 4),
          (3, 30, 300, 4, 8), 4e9),
    _rank(70, 56, 4, (6, 0, 1, 1.5, 0.75, 0.125), 2.25, 4, 12, 90, 5, 2.0, (2, 6, 4, 12),
          (5, 50, 500, 12, 24), 12e9),
    _rank(50, 26, 20, (0, 6, 3, 1.5, 0.75, 0.375), 0.25, 1, 8, 70, 4, 0.0, (0, 0, 0, 8),
          (4, 20, 100, 8, 20), 8e9),
]  # fmt: skip
THROUGHPUT = ("step_tflop", "tflops", "tflops_ranks", "mfu_pct")


def test_step_summary_of_unequal_ranks_follows_the_definitions():
    ranks = [
        replace(r, compiled_frames=f, attention_graphs=g)
        for r, f, g in zip(RANKS, (0, 3, 1, 0), (1, 0, 2, 0), strict=True)
    ]
    table = torch.stack([r.vector(torch.device("cpu")) for r in ranks])  # what gather_step returns
    got = summarize_step(7, table, peak=0.5)
    exact = {
        "step": 7,
        "step_ms": 80.0,  # T_iter: the slowest rank's step (rank 1), not the mean (65)
        "compute_ms": [16.0, 36.0, 56.0, 26.0],
        # mean_r (max_r C_r - C_r) / T_iter = mean(40, 20, 0, 30) / 80
        "straggler_pct": 100 * (0.5 + 0.25 + 0.0 + 0.375) / 4,
        "exposed_comm_ms": dict(zip(CATEGORIES, (2.0, 3.0, 2.0, 1.0, 0.5, 0.25), strict=True)),
        "exposed_collision_ms": 1.0,
        "collision_rows_pct": 25.0,  # (1 + 0 + 2 + 0) / (4 + 2 + 6 + 0)
        "collision_ids_pct": 18.75,  # (2 + 0 + 4 + 0) / (8 + 4 + 12 + 8)
        "collision_rows_pct_ranks": [25.0, 0.0, 33.333, 0.0],  # rank 3 reads no row: 0, not nan
        "data_wait_ms": 8.0,
        "rank_features": [list(r.features) for r in RANKS],
        "step_ms_ranks": [60.0, 80.0, 70.0, 50.0],
        "data_wait_ms_ranks": [8.0, 0.0, 4.0, 20.0],
        "exposed_comm_ms_ranks": {c: [r.exposed[c] for r in RANKS] for c in CATEGORIES},
        "loss": 7.0 / 32.0,  # summed BCE / candidates of all ranks
        "samples": 16,
        "items": 320,
        "compiled_frames": 3,  # the most of any rank (dynamo compiles per process)
        "attention_graphs_built": 2,  # likewise
    }
    assert set(got) == {*exact, "qps", "ne", *THROUGHPUT}
    for key, want in exact.items():
        assert got[key] == want, (key, got[key], want)
    assert isinstance(got["samples"], int) and isinstance(got["items"], int)
    tol = reduction_tol(torch.float64, terms=4, magnitude=1.0)
    # QPS: the items of all ranks per second of T_iter.
    assert math.isclose(got["qps"], 320 / 0.080, rel_tol=tol["rtol"])
    # NE: mean BCE over the entropy (nats) of the base rate 8 / 32, written out.
    p = 8 / 32
    entropy = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert math.isclose(got["ne"], (7.0 / 32.0) / entropy, rel_tol=tol["rtol"])
    # FLOPs: the step's is the ranks' sum; a rank's TFLOP/s is its FLOPs per T_iter
    # (8e9 / 0.08 s = 0.1 TFLOP/s), `tflops` their mean, MFU that mean over the peak
    assert math.isclose(got["step_tflop"], 0.032, rel_tol=tol["rtol"])
    for rate, want in zip(got["tflops_ranks"], (0.1, 0.05, 0.15, 0.1), strict=True):
        assert math.isclose(rate, want, rel_tol=1e-3)  # 4 significant digits
    assert math.isclose(got["tflops"], 0.1, rel_tol=tol["rtol"])
    assert math.isclose(got["mfu_pct"], 20.0, rel_tol=tol["rtol"])


def test_step_summary_without_a_count_or_a_peak_reports_none():
    """Null, never a made-up number: a rank without a count nulls every FLOPs
    field, an unknown peak nulls MFU, a step of no time the rates."""
    table = torch.stack([r.vector(torch.device("cpu")) for r in RANKS])
    assert summarize_step(7, table)["mfu_pct"] is None  # no peak (CPU)
    assert summarize_step(7, table)["tflops"] is not None
    uncounted = [*RANKS[:3], replace(RANKS[3], flops=None)]
    table = torch.stack([r.vector(torch.device("cpu")) for r in uncounted])
    got = summarize_step(7, table, peak=989.0)
    assert all(got[k] is None for k in THROUGHPUT)
    idle = RankStep(0.0, 0.0, 0.0, {}, 0.0, 0.0, 0.0, 0.0, 0.0, flops=5e9)
    got = summarize_step(0, gather_step(idle), peak=989.0)
    assert got["step_tflop"] == 0.005 and got["tflops"] is None and got["mfu_pct"] is None


def test_step_summary_of_an_idle_step_has_no_rates():
    """A step of zero time and no candidates: no division by zero, NaN loss."""
    idle = RankStep(0.0, 0.0, 0.0, {}, 0.0, 0.0, 0.0, 0.0, 0.0)
    got = summarize_step(0, gather_step(idle))  # one rank: no process group
    assert got["step_ms"] == 0.0 and got["straggler_pct"] == 0.0 and got["qps"] == 0.0
    assert got["collision_rows_pct"] == 0.0 and got["collision_ids_pct"] == 0.0
    assert math.isnan(got["loss"]) and math.isnan(got["ne"])


def _step_record(step: int) -> dict:
    """Step ``step`` of two ranks whose times grow with the step (dyadic: exact)."""
    k = step + 1
    ranks = [
        RankStep(8.0 * k, 4.0 * k, 0.0, {"emb_a2a": 1.0 * k}, 1.0, 1, 4, 10, 2),
        RankStep(4.0 * k, 2.0 * k, 2.0 * k, {"emb_a2a": 3.0 * k}, 2.0, 1, 4, 30, 3),
    ]
    return summarize_step(step, torch.stack([r.vector(torch.device("cpu")) for r in ranks]))


def test_run_summary_averages_the_steps_after_warmup():
    summary = RunSummary(warmup=2)
    for step in range(4):
        summary.add(_step_record(step))
    summary.evals = [{"ne": 0.75}, {"ne": 0.5}]
    got = summary.final({"mode": "sync"})
    # measured: steps 2 and 3 (k = 3, 4); samples: every step
    assert got["steps"] == 4 and got["measured_steps"] == 2 and got["samples"] == 4 * 5
    assert got["step_ms"] == (24.0 + 32.0) / 2  # T_iter of each step: the slower rank
    assert got["compute_ms_mean"] == ((12.0 + 6.0) / 2 + (16.0 + 8.0) / 2) / 2
    assert got["data_wait_ms"] == (3.0 + 4.0) / 2 and got["data_wait_ms_max"] == (6.0 + 8.0) / 2
    assert got["exposed_comm_ms"]["emb_a2a"] == (6.0 + 8.0) / 2
    assert got["exposed_comm_ms"]["grad_a2a"] == 0.0
    assert got["ne"] == 0.5 and got["ne_first_eval"] == 0.75 and got["mode"] == "sync"
    assert got["train_ne_last"] == summary.steps[-1]["ne"]
    tol = reduction_tol(torch.float64, terms=2, magnitude=1.0)
    assert math.isclose(got["qps"], (40 / 0.024 + 40 / 0.032) / 2, rel_tol=tol["rtol"])
    # a run shorter than its warm-up averages every step instead of none
    short = RunSummary(warmup=10)
    short.add(_step_record(0))
    assert short.final({})["measured_steps"] == 1 and short.final({})["ne"] is None
    # no FLOPs counted: the summary's are null, not 0
    assert all(got[k] is None for k in ("step_tflop", "tflops", "mfu_pct", "peak_tflops"))


def test_run_summary_averages_throughput_over_the_measured_steps():
    summary = RunSummary(warmup=1, peak_tflops=2.0)
    for step, (flops, ms) in enumerate([(1e12, 1000.0), (2e12, 1000.0), (4e12, 500.0)]):
        rank = RankStep(ms, ms, 0.0, {}, 1.0, 1, 4, 10, 2, flops=flops)
        summary.add(summarize_step(step, gather_step(rank), summary.peak_tflops))
    got = summary.final({})
    assert got["step_tflop"] == 3.0 and got["tflops"] == 5.0  # steps 1, 2: 2 and 8 TFLOP/s
    assert got["mfu_pct"] == 250.0 and got["peak_tflops"] == 2.0


# ---- runs with injected delays (2 CPU ranks) -------------------------------------
COMMON = [
    "run.steps=24",
    "run.warmup=6",
    "evaluation.every=0",
    "output.progress=false",
    "run.mode=sync",
]


def _steps(tmp_path, name: str, overrides: list[str]) -> tuple[list[dict], dict]:
    path = tmp_path / f"{name}.jsonl"
    summary = launch(build_config("demo", [*COMMON, *overrides, f"output.metrics_path={path}"]))
    assert summary is not None
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r["step"] >= 6], summary


@pytest.mark.slow
def test_extra_compute_on_one_rank_is_its_straggler_share(tmp_path):
    delay = 40.0
    steps, summary = _steps(
        tmp_path, "compute", [f"faults.delay_compute_ms={delay}", "faults.delay_ranks=1"]
    )
    gap = statistics.mean(r["compute_ms"][1] - r["compute_ms"][0] for r in steps)
    assert 0.8 * delay < gap < 1.25 * delay, gap
    # Two ranks, rank 1 slower by ~`delay` (above): the summary's straggler % is
    # the mean over the measured steps of mean_r (max C - C_r) / T, exactly.
    expected = statistics.mean(
        100 * statistics.mean(max(r["compute_ms"]) - c for c in r["compute_ms"]) / r["step_ms"]
        for r in steps
    )
    # The records' compute_ms are rounded to 0.001 ms: max - C_r moves by at most 0.001.
    rounding = statistics.mean(100 * 1e-3 / r["step_ms"] for r in steps)
    assert abs(summary["straggler_pct"] - expected) <= rounding, (
        summary["straggler_pct"],
        expected,
    )
    assert summary["straggler_pct"] > 0.8 * statistics.mean(
        100 * delay / (2 * r["step_ms"]) for r in steps
    )
    assert summary["data_wait_ms_max"] < 5.0


@pytest.mark.slow
def test_slow_loader_on_one_rank_is_data_wait_not_straggling(tmp_path):
    delay = 250.0  # well above the demo's step time (~50 ms on 2 cores, ~100 ms under load)
    steps, summary = _steps(
        tmp_path, "loader", [f"faults.delay_loader_ms={delay}", "faults.delay_ranks=1"]
    )
    wait0 = statistics.mean(r["data_wait_ms_ranks"][0] for r in steps)
    wait1 = statistics.mean(r["data_wait_ms_ranks"][1] for r in steps)
    step = statistics.mean(r["step_ms"] for r in steps)
    assert step > 0.9 * delay, step  # the run is loader-bound
    assert wait0 < 5.0, wait0
    # Rank 1 starves for what its loader is slower than the rest of its step.
    assert wait1 > 0.3 * delay, wait1
    # Counted as compute, the wait would give a straggler % near
    # 100 * wait1 / (2 * step) (about 25 here); as data wait it does not.
    assert summary["straggler_pct"] < 0.25 * (100 * wait1 / (2 * step)), summary


@pytest.mark.slow
def test_step_lines_carry_each_ranks_batch_features(tmp_path):
    """`rank_features` are the summed cost features of each rank's batch: the
    source's local batches without balancing; the same global sums with it."""
    from freescale.balance.world import batch_features
    from freescale.pipeline.setup import make_source

    cfg = build_config("demo", COMMON)
    source = make_source(cfg)
    want = [
        [batch_features(source.batch(s, r, 2, cfg.batch_size)).tolist() for r in range(2)]
        for s in range(cfg.steps)
    ]
    for balance in ("none", "fbs"):
        path = tmp_path / f"{balance}.jsonl"
        launch(build_config("demo", [*COMMON, f"balance={balance}", f"output.metrics_path={path}"]))
        for line in path.read_text().splitlines():
            r = json.loads(line)
            got = r["rank_features"]
            if balance == "none":
                assert got == want[r["step"]]
            else:  # samples moved between ranks; the step's totals did not change
                totals = [sum(c) for c in zip(*got, strict=True)]
                assert totals == [sum(c) for c in zip(*want[r["step"]], strict=True)]
            assert sum(f[1] + f[3] for f in got) == r["items"]
