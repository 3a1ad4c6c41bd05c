"""The step metrics blame the right cause (2 CPU ranks, injected delays).

Extra compute on one rank must appear as that rank's compute and as
straggler %; a slow loader on one rank must appear as its data wait and
leave straggler % near zero (its compute did not change).
"""

import json
import statistics

import pytest

from freescale.pipeline.config import build_config
from freescale.pipeline.launch import launch

COMMON = ["steps=24", "warmup=6", "eval_every=0", "progress=false", "mode=sync"]


def _steps(tmp_path, name: str, overrides: list[str]) -> tuple[list[dict], dict]:
    path = tmp_path / f"{name}.jsonl"
    summary = launch(build_config("demo", [*COMMON, *overrides, f"metrics_path={path}"]))
    assert summary is not None
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r["step"] >= 6], summary


@pytest.mark.slow
def test_extra_compute_on_one_rank_is_its_straggler_share(tmp_path):
    delay = 40.0
    steps, summary = _steps(tmp_path, "compute", [f"delay_compute_ms={delay}", "delay_ranks=1"])
    gap = statistics.mean(r["compute_ms"][1] - r["compute_ms"][0] for r in steps)
    assert 0.8 * delay < gap < 1.25 * delay, gap
    # Two ranks, rank 1 slower by `delay`: mean_r (max C - C_r) / T = delay / (2 T).
    expected = statistics.mean(100 * delay / (2 * r["step_ms"]) for r in steps)
    assert summary["straggler_pct"] == pytest.approx(expected, rel=0.25), (
        summary["straggler_pct"],
        expected,
    )
    assert summary["data_wait_ms_max"] < 5.0


@pytest.mark.slow
def test_slow_loader_on_one_rank_is_data_wait_not_straggling(tmp_path):
    delay = 250.0  # well above the demo's step time (~50 ms on 2 cores, ~100 ms under load)
    steps, summary = _steps(tmp_path, "loader", [f"delay_loader_ms={delay}", "delay_ranks=1"])
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
        launch(build_config("demo", [*COMMON, f"balance={balance}", f"metrics_path={path}"]))
        for line in path.read_text().splitlines():
            r = json.loads(line)
            got = r["rank_features"]
            if balance == "none":
                assert got == want[r["step"]]
            else:  # samples moved between ranks; the step's totals did not change
                totals = [sum(c) for c in zip(*got, strict=True)]
                assert totals == [sum(c) for c in zip(*want[r["step"]], strict=True)]
            assert sum(f[1] + f[3] for f in got) == r["items"]
