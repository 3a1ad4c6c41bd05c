"""`benchmarks/overhead.py`: the CPU smoke run emits its table and JSON; the
baseline guard fails on an idle rise (checked on rows, since CPU runs have no
GPU idle %). No speed is asserted here."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "overhead.py"


def _module():
    spec = importlib.util.spec_from_file_location("overhead_bench", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=cwd, env=env)


@pytest.mark.slow
def test_smoke_run_emits_table_and_json(tmp_path):
    out = tmp_path / "overhead"
    done = _run("--smoke", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["benchmark"] == "overhead" and last["failures"] == []
    rows = last["rows"]
    assert [(r["max_uih"], r["batch_size"], r["mode"]) for r in rows] == [
        (48, 4, "sync"),
        (48, 4, "sdd"),
    ]
    for r in rows:
        assert r["traced_steps"] == 2 and r["host_ms"] > 0 and r["step_ms"] > 0
        assert r["gpu_idle_pct"] is None and r["peak_mem_gb"] is None  # CPU run
    assert "| max UIH | batch | mode |" in done.stdout
    assert json.loads(out.with_suffix(".json").read_text())["rows"] == rows
    assert "GPU idle" in out.with_suffix(".md").read_text()
    # The run's own JSON is a valid baseline (no idle % on CPU: nothing to compare).
    recorded = json.loads(out.with_suffix(".json").read_text())["overrides"]
    assert _module().read_baseline(str(out.with_suffix(".json")), recorded) == {}


def _row(uih, batch, mode, idle, mem=None):
    return {"max_uih": uih, "batch_size": batch, "mode": mode, "gpu_idle_pct": idle,
            "peak_mem_gb": mem}  # fmt: skip


def test_baseline_guard_fails_on_idle_rise_above_tolerance(tmp_path):
    mod = _module()
    base_file = tmp_path / "base.json"
    recorded = [_row(2000, 32, "sync", 5.0), _row(2000, 32, "sdd", 1.0)]
    base_file.write_text(json.dumps({"rows": recorded}))
    base = mod.read_baseline(str(base_file))
    assert base == {(2000, 32, "sync"): 5.0, (2000, 32, "sdd"): 1.0}
    # As a log whose last line is the JSON line, too.
    log = tmp_path / "run.log"
    log.write_text("[1/2] ...\n" + json.dumps({"benchmark": "overhead", "rows": recorded}) + "\n")
    assert mod.read_baseline(str(log)) == base
    ok = [_row(2000, 32, "sync", 6.9), _row(2000, 32, "sdd", 0.5), _row(8000, 32, "sync", 50.0)]
    assert mod.check_baseline(ok, base, 2.0) == []
    assert ok[2]["baseline_idle_pct"] is None  # no recorded value: not judged
    bad = [_row(2000, 32, "sync", 7.1), _row(2000, 32, "sdd", 1.0)]
    [failure] = mod.check_baseline(bad, base, 2.0)
    assert "2000" in failure and "sync" in failure and "7.10%" in failure


def test_baseline_of_other_overrides_is_refused(tmp_path):
    mod = _module()
    base_file = tmp_path / "base.json"
    rows = [_row(2000, 32, "sync", 5.0)]
    base_file.write_text(json.dumps({"overrides": ["dense_graphs=true"], "rows": rows}))
    assert mod.read_baseline(str(base_file), ["dense_graphs=true"]) == {(2000, 32, "sync"): 5.0}
    with pytest.raises(ValueError, match="recorded with --set \\['dense_graphs=true'\\]"):
        mod.read_baseline(str(base_file))
    base_file.write_text(json.dumps({"rows": rows}))  # an old baseline: recorded without --set
    with pytest.raises(ValueError, match="this run has \\['dense_graphs=true'\\]"):
        mod.read_baseline(str(base_file), ["dense_graphs=true"])


def test_memory_ratio_is_against_sync_at_the_same_point():
    mod = _module()
    rows = [_row(2000, 32, "sync", 1, 10.0), _row(2000, 32, "sdd", 1, 10.5),
            _row(8000, 32, "sdd", 1, 3.0)]  # fmt: skip
    mod.add_memory_ratios(rows)
    assert [r["mem_vs_sync"] for r in rows] == [1.0, pytest.approx(1.05), None]


@pytest.mark.parametrize(
    "args",
    [["--baseline", "/nonexistent/base.json"], ["--trace-steps", "0-1"], ["--max-uih", "x"]],
)
def test_user_errors_are_one_line_rc2(tmp_path, args):
    done = _run("--smoke", "--out", str(tmp_path / "o"), *args, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1


def test_repeated_point_reports_the_median_idle_run():
    mod = _module()
    runs = [dict(_row(2000, 32, "sync", idle), step_ms=k) for k, idle in enumerate([9.6, 4.5, 5.1])]
    row = mod.median_row(runs)
    assert row["gpu_idle_pct"] == 5.1 and row["step_ms"] == 2  # the median run, whole
    assert row["gpu_idle_pct_runs"] == [9.6, 4.5, 5.1]
    assert mod.median_row(runs[:2])["gpu_idle_pct"] == 4.5  # even count: the lower middle
    cpu = mod.median_row([_row(48, 4, "sync", None), _row(48, 4, "sync", None)])
    assert cpu["gpu_idle_pct"] is None and cpu["gpu_idle_pct_runs"] == [None, None]


def test_repeat_below_one_is_an_error(tmp_path):
    done = _run("--smoke", "--repeat", "0", "--out", str(tmp_path / "o"), cwd=tmp_path)
    assert done.returncode == 2 and "--repeat must be >= 1" in done.stderr
