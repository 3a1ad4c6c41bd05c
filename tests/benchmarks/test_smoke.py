"""Every scenario end to end in ``--smoke`` mode on the CPU (slow: minutes).

Each run must exit 0 and write a report whose header says smoke, with at
least one row; the fast twins of these checks are in test_harness.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import report
from benchmarks.scenario import load, names

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("name", names())
def test_scenario_smoke(name, tmp_path):
    if missing := load(name).missing_inputs():
        pytest.skip("; ".join(missing))
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "run", name, "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    head, rows, _ = report.read(tmp_path / f"{name}.jsonl")
    assert head["smoke"] and head["scenario"] == name and rows
    assert (tmp_path / f"{name}.md").read_text().startswith("# ")
