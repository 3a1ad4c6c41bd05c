"""`benchmarks/scaling.py` (and the sweep machinery under straggler/baseline) on CPU ranks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_scaling_sweep_runs_at_two_and_four_ranks(tmp_path):
    out = tmp_path / "scaling"
    cmd = [
        sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--preset", "demo",
        "--nproc", "2,4", "--max-uih", "500", "--batch", "4", "--balance", "cost",
        "--steps", "3", "--warmup", "1", "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.with_suffix(".json").read_text())
    assert [r["nproc"] for r in data["rows"]] == [2, 4]
    assert all(r["balance"] == "cost" and r["measured_steps"] == 2 for r in data["rows"])
    steps = sorted((tmp_path / "scaling-steps").glob("*.jsonl"))
    assert len(steps) == 2
    records = [json.loads(x) for x in steps[1].read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2] and len(records[0]["compute_ms"]) == 4
    md = out.with_suffix(".md").read_text()
    assert md.count("| cost |") == 2 and "scaling.py" in md
    # The report can be rebuilt from the JSON alone.
    out.with_suffix(".md").unlink()
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sweep.py"), str(out) + ".json"],
                   check=True, cwd=ROOT)  # fmt: skip
    assert out.with_suffix(".md").read_text() == md
