"""`benchmarks/kernels.py --quick --device cpu` runs, checks its outputs and reports."""

import json
import subprocess
import sys
from pathlib import Path

from .conftest import clean_env

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "kernels.py"


def test_quick_cpu_benchmark(tmp_path):
    out = tmp_path / "kernels.md"
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    rows = summary["results"]
    ops = {"permute", "transpose", "bucketize", "dispatch_ids", "dispatch_emb", "combine_emb"}
    assert {r["op"] for r in rows} >= ops | {"collision"}
    assert {r["world_size"] for r in rows} == {2, 4}
    assert all(r["eager_ok"] and r["torch_ms"] > 0 and r["eager_ms"] > 0 for r in rows)
    report = out.read_text()
    assert "| op | W |" in report and "command:" in report and "copy bandwidth" in report
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["device"] == "cpu" and len(saved["results"]) == len(rows)
