"""The dynamic-table scenario's code path at tiny sizes: the static and dynamic cases
train the same steps, the peak measure sees tensor memory, the flat check streams
10x capacity distinct ids."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from benchmarks import dynamic_table
from benchmarks.runner import Ctx
from benchmarks.scenario import load
from freescale.comm.fake import FakeCommunicator, FakeWorld

CPU = torch.device("cpu")
FLAT = {**dynamic_table.DEFAULTS["flat"], "capacity": 60, "new_per_step": 12, "hot": 8}
TINY = {"universe": 400, "ids_per_step": 128, "dim": 4, "warmup": 6, "steps": 2, "flat": FLAT}


def tiny_args() -> SimpleNamespace:
    return SimpleNamespace(**{**dynamic_table.DEFAULTS, **TINY})


def test_static_and_dynamic_cases_train_the_same_steps():
    args = tiny_args()
    comm = FakeCommunicator(FakeWorld(1), 0, CPU)
    steps = dynamic_table.zipf_steps(args, CPU)
    cases = [["static", 1.0, "", 1], ["dynamic", 1.0, "lru", 1], ["dynamic", 0.5, "lfu", 1]]
    static, roomy, small = (dynamic_table.run_case(args, comm, CPU, c, steps) for c in cases)
    assert static["unique_per_step"] == roomy["unique_per_step"] == small["unique_per_step"]
    assert static["slots"] == roomy["slots"] == 400 and small["slots"] == 200
    assert roomy["evictions_per_step"] == 0 and roomy["held_mb"] > static["held_mb"]  # the map
    assert small["evictions_per_step"] > 0 and small["occupancy_pct"] == 100.0
    for row in (static, roomy, small):
        assert row["lookups_per_s"] > 0 and row["updates_per_s"] > 0 and row["peak_mb"] >= 0


def test_the_peak_is_tensor_memory_and_each_window_starts_afresh():
    mem = dynamic_table.Memory(CPU)
    mem.window()
    x = torch.ones(16 * 2**20)  # 64 MiB, written
    del x
    assert mem.peak_mb() >= 60
    mem.window()
    assert mem.peak_mb() < 30


def test_the_flat_run_streams_ten_times_capacity_distinct_ids():
    args = tiny_args()
    row = dynamic_table.run_flat(args, FakeCommunicator(FakeWorld(1), 0, CPU), CPU)
    assert row["distinct_ids"] >= 10 * 60 and len(row["peak_mb_passes"]) == 10
    assert row["evictions"] >= row["distinct_ids"] - 60
    assert row["flat_ok"] is True


@pytest.mark.slow  # its flat run is a child process (seconds); test_smoke runs it too
def test_the_smoke_scenario_reports_every_case_and_the_flat_check(tmp_path):
    s = load("dynamic-table").smoked()
    result = dynamic_table.measure(s, Ctx(out=tmp_path / "r", raw=tmp_path, smoke=True))
    cases = [r["case"] for r in result.rows]
    assert cases[:2] == ["static", "dynamic lru 25% admit 2"] and cases[2].startswith("flat:")
    assert result.rows[0]["step_vs_static"] == 1.0 and result.rows[1]["not_admitted_per_step"] > 0
    assert "## Memory flat" in result.sections
