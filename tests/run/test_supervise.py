"""The launcher's watch (`freescale.run.supervise`) on stand-in ranks: forked
processes that end as ranks do, without torch, so each case takes well under a
second. The end-to-end cases, with real ranks: test_rank_death.py."""

import multiprocessing
import os
import signal
import time

import pytest

from freescale.config import build_config
from freescale.run.launch import JobFile, launch
from freescale.run.rank_stderr import RankStderr
from freescale.run.supervise import (
    ECHO_GRACE_S,
    Rank,
    RunFailed,
    RunStopped,
    StopSignals,
    Supervisor,
)

CTX = multiprocessing.get_context("fork")


def _ends(messages, ready, how: str) -> None:
    # A spawned rank starts with the default dispositions; a forked one inherits
    # the test process's (pytest-xdist's worker handles SIGTERM itself).
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_DFL)
    ready.set()
    if how == "summary":
        messages.send(("summary", {"loss": 0.5}))
    elif how == "echo":  # a peer's error: it saw the other rank go
        time.sleep(0.2)
        messages.send(("error", "RuntimeError: Connection closed by peer"))
        os._exit(1)
    elif how == "error":  # a rank's own error, no peer gone
        messages.send(("error", "RuntimeError: the model raised"))
        os._exit(1)
    elif how in ("crash", "slow crash"):
        # after the echo was sent; "slow": past PEER_GRACE_S, as on a loaded machine
        time.sleep(0.3 if how == "crash" else 4.0)
        os.write(2, b"out of memory\n")
        os.kill(os.getpid(), signal.SIGKILL)
    elif how == "hang":
        time.sleep(60)
    os._exit(0)


def _ranks(*hows: str, stderr: bool = False) -> list[Rank]:
    ranks = []
    for index, how in enumerate(hows):
        messages, rank_end = CTX.Pipe(duplex=False)
        ready = CTX.Event()
        process = CTX.Process(target=_ends, args=(rank_end, ready, how))
        tail = RankStderr() if stderr else None
        if tail is not None:
            with tail.attached():
                process.start()
            tail.started()
        else:
            process.start()
        rank_end.close()
        # A signal sent before the rank has reset its dispositions would meet the
        # inherited handler (seen once in CI: SIGKILL after the grace, not SIGTERM).
        assert ready.wait(10), f"stand-in rank {index} did not start"
        ranks.append(Rank(index, process, messages, tail))
    return ranks


def test_the_summary_comes_back():
    assert Supervisor(_ranks("summary", "done"), StopSignals(), 10).run() == {"loss": 0.5}


def test_a_crash_is_named_not_its_echo():
    ranks = _ranks("echo", "crash", stderr=True)
    with pytest.raises(RunFailed) as e:
        Supervisor(ranks, StopSignals(), 10).run()
    assert str(e.value) == (
        "rank 1 was killed by signal 9 (SIGKILL); its stderr ended: out of memory"
    )


def test_a_slow_crash_is_named_not_its_echo():
    ranks = _ranks("echo", "slow crash", stderr=True)
    with pytest.raises(RunFailed, match=r"^rank 1 was killed by signal 9 \(SIGKILL\)"):
        Supervisor(ranks, StopSignals(), 10).run()


def test_a_rank_s_own_error_ends_the_run_without_the_echo_wait():
    ranks = _ranks("error", "hang")
    start = time.monotonic()
    with pytest.raises(RunFailed, match=r"^rank 0 failed: RuntimeError: the model raised$"):
        Supervisor(ranks, StopSignals(), 10).run()
    assert time.monotonic() - start < ECHO_GRACE_S
    assert not ranks[1].process.is_alive()


def test_a_rank_that_never_finishes_is_named_and_killed():
    ranks = _ranks("summary", "hang")
    start = time.monotonic()
    with pytest.raises(RunFailed, match=r"^rank 1 did not finish 1 s \(timeout_s\) after"):
        Supervisor(ranks, StopSignals(), 1.0).run()
    assert time.monotonic() - start < 5
    assert not ranks[1].process.is_alive()


def test_sigterm_while_waiting_ends_the_run_with_143():
    ranks = _ranks("hang", "hang")
    with StopSignals() as stop:
        stop.ranks.extend(ranks)
        os.kill(os.getpid(), signal.SIGTERM)  # handled at once, in this (main) thread
        with pytest.raises(RunStopped) as e:
            Supervisor(ranks, stop, 10).run()
    assert e.value.exit_code == 143
    assert [r.exitcode for r in ranks] == [-signal.SIGTERM] * 2  # forwarded


def test_a_rank_importing_an_unguarded_script_does_not_train_again(monkeypatch):
    """In a spawned rank still importing the main script, `freescale.train` at its
    top level raises at once, saying to add the guard (end to end, with the
    launcher's line: test_rank_death.py, slow)."""
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match=r'under `if __name__ == "__main__":`$'):
        launch(build_config("demo"))


def test_job_files_of_dead_launchers_are_swept(tmp_path):
    """The Python API's pickled model and data (`JobFile`) outlive a SIGKILLed
    launcher; the next launch removes them, and only them."""
    gone = CTX.Process(target=os._exit, args=(0,))
    gone.start()
    gone.join()
    stale = tmp_path / f"{JobFile.PREFIX}{gone.pid}-abc.pkl"
    live = tmp_path / f"{JobFile.PREFIX}{os.getpid()}-def.pkl"
    other = tmp_path / "freescale-job-notapid-x.pkl"
    for path in (stale, live, other):
        path.write_bytes(b"")
    JobFile.sweep(str(tmp_path))
    assert not stale.exists() and live.exists() and other.exists()
