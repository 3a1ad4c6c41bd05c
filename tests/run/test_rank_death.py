"""A rank that dies, at any time and for any reason, ends the run.

Through the real launcher, as a user runs it (`freescale train` with 2 CPU
ranks, or a script calling `freescale.train`), in a session of its own: the
launcher exits non-zero within seconds with one line naming the rank, how it
ended and the last lines of its stderr, and leaves no process behind
(checked by pid: the session is empty). SIGTERM to a launcher whose ranks
never started ends it too, with 143.
"""

import os
import signal
import textwrap
import time

import pytest

from freescale.comm.nixl_support import nixl_installed
from freescale.testing.processes import Finished, children, python, run_session

LIMIT_S = 30  # the bound for a rank's death to end the run
MODEL = "model=tests.run._dying_model:build"
TRAIN = python("-m", "freescale.cli.main", "train")
for key in (
    "run.warmup=1",
    "evaluation.every=0",
    "output.progress=false",
    "run.steps=200",
    "run.batch_size=8",
    "model.dim=16",
    "model.layers=1",
    "run.timeout_s=60",
    MODEL,
):
    TRAIN += ["--set", key]  # fmt: skip


def _train(*sets: str, env: dict | None = None) -> Finished:
    cmd = [*TRAIN]
    for key in sets:
        cmd += ["--set", key]
    return run_session(cmd, LIMIT_S + 30, env=env)


def _check_ended(run: Finished, *expected: str) -> None:
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.wall_s < LIMIT_S, run.wall_s
    assert run.left == [], f"processes left behind: {run.left}"
    line = run.last_line
    assert line.startswith("freescale: error: rank 1 "), run.stderr[-3000:]
    for text in expected:
        assert text in line, line
    print(f"{run.wall_s:.1f} s: {line}")


def test_a_rank_killed_mid_run_ends_the_run():
    run = _train("model.die=kill", "model.die_step=3")
    _check_ended(run, "killed by signal 9 (SIGKILL)", "_dying_model: rank dies (kill)")


@pytest.mark.slow
@pytest.mark.skipif(not nixl_installed(), reason="no NIXL (pip install 'freescale[rdma]')")
def test_a_rank_killed_mid_run_on_nixl_ends_the_run_and_leaves_nothing():
    shm_before = set(os.listdir("/dev/shm"))
    run = _train("model.die=kill", "model.die_step=3", "pipeline.comm_backend=smfree-nixl")
    _check_ended(run, "killed by signal 9 (SIGKILL)")
    # UCX's or NIXL's (other jobs on the machine may create files of their own meanwhile)
    left = {f for f in set(os.listdir("/dev/shm")) - shm_before if "ucx" in f or "nixl" in f}
    assert left == set(), left


@pytest.mark.slow
def test_a_rank_that_exits_at_import_ends_the_run():
    run = _train(env={"FREESCALE_TEST_EXIT_AT_IMPORT": "1"})
    _check_ended(run, "exited with code 1", "libexample.so: cannot open shared object file")


@pytest.mark.slow
def test_a_rank_killed_before_its_first_step_ends_the_run():
    run = _train("model.die=kill", "model.die_step=-1")
    _check_ended(run, "killed by signal 9 (SIGKILL)")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "signal_text"), [("abort", "6 (SIGABRT)"), ("segv", "11 (SIGSEGV)")]
)
def test_a_rank_that_crashes_ends_the_run(how, signal_text):
    run = _train(f"model.die={how}", "model.die_step=2")
    _check_ended(run, f"killed by signal {signal_text}", f"rank dies ({how})")


@pytest.mark.slow
def test_a_rank_that_calls_exit_ends_the_run():
    run = _train("model.die=exit", "model.die_step=2")
    _check_ended(run, "exited with code 3")


UNGUARDED = """
import freescale
from examples.categories import build, data

freescale.train(model=build, data=data(), run={"nproc": 2, "steps": 5, "warmup": 1},
                evaluation={"every": 0}, output={"progress": False})
"""


def _check_guard_hint(run: Finished) -> None:
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.wall_s < LIMIT_S, run.wall_s
    assert run.left == [], f"processes left behind: {run.left}"
    line = run.last_line
    assert "rank 0 exited with code 1" in line or "rank 1 exited with code 1" in line, line
    assert 'if __name__ == "__main__":' in line, line
    print(f"{run.wall_s:.1f} s: {line}")


@pytest.mark.slow
def test_a_script_without_the_main_guard_is_told_to_add_it(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(UNGUARDED))
    _check_guard_hint(run_session(python(str(script)), LIMIT_S + 30))


@pytest.mark.slow
def test_a_script_on_standard_input_ends():
    run = run_session(python("-"), LIMIT_S + 30, stdin=textwrap.dedent(UNGUARDED))
    assert run.wall_s < LIMIT_S and run.left == [], (run.wall_s, run.left, run.stderr[-2000:])
    assert run.returncode == 1, run.stderr[-3000:]
    assert run.last_line.startswith("ValueError: spawned ranks import the main script again"), (
        run.last_line
    )
    assert "'<stdin>' is not a file" in run.last_line


@pytest.mark.parametrize(
    "stop", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)]
)
def test_a_stop_signal_ends_a_launcher_whose_ranks_never_started(stop):
    def send(proc) -> None:
        deadline = time.monotonic() + LIMIT_S
        while len(children(proc.pid)) < 3 and time.monotonic() < deadline:  # 2 ranks + tracker
            time.sleep(0.05)
        time.sleep(0.5)  # the ranks are importing the model, which hangs
        proc.send_signal(stop)
        send.at = time.monotonic()

    run = run_session(TRAIN, LIMIT_S + 30, env={"FREESCALE_TEST_HANG_AT_IMPORT": "1"}, during=send)
    assert run.returncode == 128 + stop, run.stderr[-3000:]
    print(f"{signal.Signals(stop).name}: ended {run.ended_at - send.at:.1f} s after it")
    assert run.ended_at - send.at <= 10
    assert run.left == [], f"processes left behind: {run.left}"
    assert (
        run.last_line
        == f"freescale: stopped by {signal.Signals(stop).name} before the run finished"
    )
