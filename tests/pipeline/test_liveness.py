"""Liveness through the real launcher (the CLI in a subprocess): a frozen rank
is named within seconds of ``timeout_s``, no rank outlives a killed launcher,
and SIGTERM stops cleanly (step finished, checkpoint, summary, exit 143)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from freescale.state.checkpoint import find_checkpoint, read_manifest

pytestmark = pytest.mark.slow


def _start(tmp_path: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, "-m", "freescale.cli.main", "train", "--set", "output.progress=false",
           "--set", "evaluation.every=0", "--set", "run.warmup=1",
           "--set", f"output.metrics_path={metrics}",
           *args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, metrics


def _wait_steps(proc: subprocess.Popen, metrics: Path, steps: int, limit: float = 90) -> None:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError("training did not start")


def _ranks(parent: int) -> list[int]:
    """The launcher's rank processes, in start (= rank) order."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"resource_tracker" not in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_frozen_rank_is_named_after_timeout_s(tmp_path):
    proc, metrics = _start(tmp_path, "--set", "run.steps=100000", "--set", "run.timeout_s=8")
    try:
        _wait_steps(proc, metrics, 3)
        ranks = _ranks(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(ranks[1], signal.SIGSTOP)
        frozen = time.monotonic()
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - frozen
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("freescale: error: rank 0 failed"), err
    assert "timed out after 8 s" in last and "rank 1 is unresponsive" in last, last
    print(f"frozen rank: error after {elapsed:.1f} s: {last}")
    assert elapsed < 8 + 10, elapsed  # the configured timeout, not 10 minutes
    assert not any(_alive(p) for p in ranks)


def test_no_rank_survives_a_sigkilled_launcher(tmp_path):
    proc, metrics = _start(tmp_path, "--set", "run.steps=100000")
    try:
        _wait_steps(proc, metrics, 2)
        ranks = _ranks(proc.pid)
        assert len(ranks) == 2, ranks
        proc.kill()
        proc.wait()
        killed = time.monotonic()
        while any(_alive(p) for p in ranks) and time.monotonic() - killed < 10:
            time.sleep(0.05)
        gone_after = time.monotonic() - killed
    finally:
        proc.kill()
    print(f"launcher SIGKILLed: ranks gone after {gone_after:.2f} s")
    assert not any(_alive(p) for p in ranks), "orphaned ranks 10 s after the launcher died"
    assert gone_after < 10


def test_sigterm_finishes_the_step_checkpoints_and_exits_143_then_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    args = (
        "--set",
        "run.steps=40",
        "--set",
        f"checkpoint.dir={ckpt}",
        "--set",
        "faults.delay_compute_ms=30",
    )
    proc, metrics = _start(tmp_path, *args)
    try:
        _wait_steps(proc, metrics, 3)
        proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        out, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 143, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["stopped"] == "SIGTERM"
    last = summary["last_step"]
    print(f"SIGTERM: exit 143 after {elapsed:.1f} s, stopped after step {last}")
    assert last < 39 and elapsed < 10
    saved = find_checkpoint(ckpt)
    assert saved is not None and read_manifest(saved)["step"] == last + 1
    # every step up to the stop has its metrics line, none after it
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(last + 1))
    proc = subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", "train", "--set", "output.progress=false",
         "--set", "evaluation.every=0", "--set", "run.warmup=1",
         "--set", f"output.metrics_path={metrics}",
         *args, "--resume"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1])["first_step"] == last + 1
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(40))
