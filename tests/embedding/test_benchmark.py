"""The embedding benchmark's CPU quick mode runs end to end (1 rank, and 2 under torchrun)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "embedding.py"
PHASES = ("preflight", "ids_a2a", "lookup", "emb_a2a", "grad_a2a", "update")


def _run(cmd: list[str], out: Path) -> dict:
    proc = subprocess.run(
        [*cmd, "--device", "cpu", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("HBM copy:") and "| rows |" in lines[1]
    return json.loads(lines[-1])


def _check(summary: dict, world_size: int, out: Path) -> None:
    assert summary["benchmark"] == "embedding" and summary["world_size"] == world_size
    assert [r["rows"] for r in summary["results"]] == [10_000, 100_000]
    for r in summary["results"]:
        assert r["ids"] == 200 and 0 < r["u"] <= r["m"]
        assert all(r[p] > 0 for p in PHASES)
        assert r["lookup_gbps"] > 0 and r["lookup_hbm_frac"] > 0
    report = out.read_text()
    for needle in ("- machine:", "- date:", "- command:", "--quick", "| rows |"):
        assert needle in report


def test_quick_cpu_single_rank(tmp_path):
    out = tmp_path / "bench.md"
    _check(_run([sys.executable, str(SCRIPT)], out), 1, out)


def test_quick_cpu_two_ranks_under_torchrun(tmp_path):
    torchrun = Path(sys.executable).parent / "torchrun"
    if not torchrun.exists():
        pytest.skip("torchrun not installed next to the interpreter")
    out = tmp_path / "bench2.md"
    cmd = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(SCRIPT)]
    summary = _run(cmd, out)
    _check(summary, 2, out)
    assert "torchrun --nproc-per-node 2" in out.read_text()
