"""A job survives a lost worker: ``torchrun --max-restarts 1
... train --resume auto``, a worker SIGKILLed at step 20 of 60, the job restarts
from the newest checkpoint and completes with the losses of an uninterrupted
run, bit for bit; its metrics file has every step once.

The restart at another number of workers (``--nnodes 1:2``, one node lost)
resumes through the resharding resume: from the restored step on, the losses
are those of a run resumed at the new world size from the same checkpoint.
And the launcher SIGKILLed again and again while it writes checkpoints never
leaves a torn one that a restart would take.
"""

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from freescale.config import build_config
from freescale.pipeline.train import Trainer
from freescale.state.checkpoint import PREFIX, check_resumable, find_checkpoint, read_manifest
from freescale.testing import run_ranks
from freescale.testing.multirank import free_port
from freescale.testing.processes import (
    ROOT,
    Finished,
    children,
    python,
    run_session,
    session_members,
)

STEPS, KILLED_AT, EVERY = 60, 20, 7  # the newest checkpoint before the kill continues at 14
RESTORED = KILLED_AT // EVERY * EVERY
LIMIT_S = 120
KEYS = [
    "run.warmup=1", "evaluation.every=0", "output.progress=false", "run.batch_size=8",
    "model=tests.run._dying_model:build", "model.dim=16", "model.layers=1",
    f"run.steps={STEPS}", "run.timeout_s=30",
]  # fmt: skip
ENV = {"GLOO_SOCKET_IFNAME": "lo"}


def _train_args(tmp_path: Path, *more: str) -> list[str]:
    keys = [*KEYS, f"checkpoint.dir={tmp_path / 'ckpt'}", f"checkpoint.every={EVERY}"]
    keys.append(f"output.metrics_path={tmp_path / 'm'}")
    args = ["-m", "freescale.cli.main", "train", "--resume", "auto"]
    for key in [*keys, *more]:
        args += ["--set", key]
    return args


def _rows(tmp_path: Path) -> list[tuple[int, float]]:
    lines = (tmp_path / "m").read_text().splitlines()
    return [(r["step"], r["loss"]) for r in map(json.loads, lines)]


def _reference_rank(keys: list[str]) -> list[tuple[int, float]]:
    trainer = Trainer(build_config("demo", keys))
    trainer.run()
    return [(s["step"], s["loss"]) for s in trainer.summary.steps]


def _check_restarted(run: Finished) -> dict:
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.left == [], f"processes left behind: {run.left}"
    assert "_dying_model: rank dies (kill)" in run.stderr
    said = [line for line in run.stderr.splitlines() if "checkpoint.resume=auto" in line]
    assert len(said) == 2 and "starting at step 0" in said[0], said
    assert said[1].endswith(f"{PREFIX}{RESTORED:08d} (step {RESTORED})"), said
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    assert summary["first_step"] == RESTORED and summary["resumed"]["step"] == RESTORED
    return summary


def test_a_killed_worker_restarts_from_the_newest_checkpoint(tmp_path):
    die = ["model.die=kill", f"model.die_step={KILLED_AT}", "model.die_attempt=0"]
    cmd = python(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "1", "--monitor-interval", "0.1",
        *_train_args(tmp_path, *die),
    )  # fmt: skip
    run = run_session(cmd, LIMIT_S, env=ENV)
    _check_restarted(run)
    print(f"torchrun, a worker killed at step {KILLED_AT}, restarted: {run.wall_s:.1f} s")
    reference = run_ranks(_reference_rank, 2, KEYS, timeout=LIMIT_S)[0]
    assert _rows(tmp_path) == reference  # every step once, each loss bit for bit


@pytest.mark.slow
def test_a_restart_with_fewer_workers_reshards(tmp_path):
    """Two agents of one worker each (``--nnodes 1:2``); one agent dies with its
    worker at step 20; the other restarts alone (world size 1) from step 14."""
    port = free_port()
    agents = []

    def node(host: bool) -> list[str]:  # a torchrun agent: one node of one worker
        return python(
            "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "1",
            "--max-restarts", "1", "--monitor-interval", "0.1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"restart-{port}", "--local-addr", "127.0.0.1",
            "--rdzv-conf", f"is_host={str(host).lower()},last_call_timeout=2,join_timeout=60",
            *_train_args(tmp_path, "checkpoint.keep=20", "faults.delay_compute_ms=30"),
        )  # fmt: skip

    def lose_the_second_node(proc: subprocess.Popen) -> None:
        log = (tmp_path / "second-node.log").open("w")
        env = {**os.environ, **ENV, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        second = subprocess.Popen(
            node(host=False), cwd=ROOT, env=env, start_new_session=True, stdout=log, stderr=log
        )
        agents.append(second)
        metrics, deadline = tmp_path / "m", time.monotonic() + LIMIT_S
        while time.monotonic() < deadline and second.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= KILLED_AT:
                break
            time.sleep(0.02)
        for pid in children(second.pid):  # its worker, then the agent: the node is gone
            os.kill(pid, signal.SIGKILL)
        os.killpg(second.pid, signal.SIGKILL)

    run = run_session(node(True), LIMIT_S * 2, env=ENV, during=lose_the_second_node)
    for agent in agents:
        agent.wait(timeout=10)
        assert session_members(agent.pid) == [], "the lost node left processes behind"
    assert run.returncode == 0, run.stderr[-4000:]
    assert run.left == [], run.left
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    restored = summary["first_step"]
    assert summary["world_size"] == 1 and summary["resumed"]["from_world_size"] == 2
    ckpt = tmp_path / "ckpt" / f"{PREFIX}{restored:08d}"
    resumed = run_ranks(_reference_rank, 1, [*KEYS, f"checkpoint.resume={ckpt}"], timeout=LIMIT_S)
    rows = _rows(tmp_path)
    assert [s for s, _ in rows] == list(range(STEPS))
    assert rows[restored:] == resumed[0]


@pytest.mark.slow
def test_sigkill_while_checkpointing_never_leaves_a_torn_checkpoint(tmp_path):
    """The launcher SIGKILLed four times in a row, each time while a checkpoint
    is being written (every 3 steps): each restart (the same command, with
    ``--resume auto``) takes the newest whole checkpoint; the run completes
    with the uninterrupted run's losses, every step once."""
    ckpt = tmp_path / "ckpt"
    cmd = python(*_train_args(tmp_path, "faults.delay_compute_ms=20"))
    cmd = [c.replace(f"checkpoint.every={EVERY}", "checkpoint.every=3") for c in cmd]
    restored = []

    def partials() -> set[tuple[str, int]]:
        found = set()
        for p in ckpt.glob(f"{PREFIX}*.partial"):
            with contextlib.suppress(OSError):
                found.add((p.name, p.stat().st_ino))
        return found

    def kill_while_saving(proc: subprocess.Popen) -> None:
        left_over = partials()  # by an earlier kill: not this run's
        deadline = time.monotonic() + LIMIT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if partials() - left_over:
                break
            time.sleep(0.002)
        proc.kill()  # the launcher only: its ranks die with it

    for _ in range(4):
        run = run_session(cmd, LIMIT_S, env=ENV, during=kill_while_saving)
        assert run.returncode == -signal.SIGKILL, run.stderr[-3000:]
        assert run.left == [], f"ranks outlived the launcher: {run.left}"
        newest = find_checkpoint(ckpt)
        if newest is not None:  # whole: every file's size and digest as its manifest says
            check_resumable(str(newest), build_config("demo", KEYS).as_dict())
            restored.append(read_manifest(newest)["step"])
    print(f"launcher SIGKILLed while saving, 4 times: restarts resumed at steps {restored}")
    assert restored == sorted(restored) and restored[-1] > 0, restored
    run = run_session(cmd, LIMIT_S, env=ENV)
    assert run.returncode == 0 and run.left == [], run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1])["first_step"] == restored[-1]
    reference = run_ranks(_reference_rank, 2, KEYS, timeout=LIMIT_S)[0]
    assert _rows(tmp_path) == reference
