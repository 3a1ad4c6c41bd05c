"""Watch the ranks a launcher spawned until they finish, fail or are stopped.

One `multiprocessing.connection.wait` covers everything that can happen: each
rank's process sentinel (ready when the process ends, whatever ended it:
an error, ``exit``, a signal, a crash while Python started it), each rank's
message pipe (its summary, or its one-line error), and a socket the signal
module writes to when SIGTERM or SIGINT arrives (`signal.set_wakeup_fd`).
Nothing is polled, and no state waits forever:

- **A rank ends early.** The first rank that exits with anything but success
  ends the run within the wait: every other rank is killed and `RunFailed`
  names it: the error it sent, or else its exit code or signal and the last
  lines of its stderr (`rank_stderr`). A rank that died without a word is
  named before one that raised, whose error may only be its peer gone
  (after such an error the watch waits up to 2 s for a peer to end, 15 s
  when every error says a peer went away).
- **Bad input.** A rank's ValueError (bad data or input, which the ranks
  agree on and raise alike) is `RankInputError`, a ValueError with that
  rank's line as it is (CLI rc 2, as under torchrun).
- **One rank done, another never.** ``timeout_s`` after the first rank
  finished, the others are killed and named.
- **Stopped.** The first SIGTERM or SIGINT is passed on to every rank
  (SIGTERM: they finish the step, checkpoint and send their summary; a
  rank that has not built its trainer yet, or SIGINT, ends at once). The ranks get
  ``timeout_s`` to end, a second signal kills them at once. Without a
  summary the run raises `RunStopped` (exit 143 for SIGTERM, 130 for SIGINT).
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import torch

from freescale.pipeline.liveness import EXIT_STOPPED
from freescale.run.rank_stderr import RankStderr

EXIT_INPUT = 2  # a spawned rank's exit status after a ValueError (its line went to the launcher)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
PEER_GRACE_S = 2.0  # after a rank raised: how long a crashed peer may take to be reaped
# An error that says a peer went away is an echo: the peer's process may take
# seconds more to finish exiting (a loaded machine, torch's teardown), so the
# cause gets longer to show. Seen in CI: rank 0's "Connection closed by peer"
# arrived > 2 s before rank 1, exiting at import, was reaped.
ECHO_GRACE_S = 15.0
ECHO_WORDS = (
    "connection closed by peer",  # gloo
    "connection reset by peer",
    "broken pipe",
    "remote process exited",  # NCCL
    "communicator was aborted",
)


class RunFailed(RuntimeError):
    """A rank failed; the message names the rank and its error, on one line."""


class RankInputError(RunFailed, ValueError):
    """A rank raised a ValueError (bad data or input): its one line, as it is."""


class RunStopped(RuntimeError):
    """SIGTERM or SIGINT ended the run before the ranks sent a summary."""

    def __init__(self, signum: int, detail: str = "") -> None:
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} before the run finished{detail}")
        self.exit_code = 128 + signum


@dataclass
class Rank:
    """One spawned rank as the launcher sees it."""

    index: int
    process: Any  # a started multiprocessing Process
    messages: Any  # the launcher's end of the rank's message pipe
    stderr: RankStderr | None = None
    error: tuple[str, str] | None = None  # (kind, line) the rank sent

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode


def exit_text(code: int | None) -> str:
    """How a process ended, for the one-line error."""
    if code is None:
        return "did not finish"
    if code >= 0:
        return f"exited with code {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "an unknown signal"
    return f"was killed by signal {-code} ({name})"


class StopSignals:
    """SIGTERM/SIGINT while ranks run (main thread only): the first is passed on to
    the ranks, a second kills them; a socket wakes the launcher's wait."""

    def __init__(self) -> None:
        self.ranks: list[Rank] = []
        self.received: int | None = None
        self.at = 0.0
        self.wakeup: socket.socket | None = None
        self._notify: socket.socket | None = None
        self._previous: dict[int, Any] = {}
        self._previous_fd = -1
        self._forwarded: set[int] = set()

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # (signals reach only the main thread's handlers)
        self.wakeup, self._notify = socket.socketpair()
        self.wakeup.setblocking(False)
        self._notify.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._notify.fileno())
        for signum in STOP_SIGNALS:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        if self.wakeup is not None:
            signal.set_wakeup_fd(self._previous_fd)
            self.wakeup.close()
            self._notify.close()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received, self.at = signum, time.monotonic()
            self.forward()
        else:
            kill(self.ranks, wait_s=0)

    def forward(self) -> None:
        """Pass the signal received on to every running rank that did not get it."""
        if self.received is None:
            return
        for rank in self.ranks:  # (not reaped yet: the pid is still the rank's)
            if rank.index not in self._forwarded and rank.exitcode is None:
                self._forwarded.add(rank.index)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(rank.process.pid, self.received)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self.wakeup.recv(4096)


def kill(ranks: list[Rank], wait_s: float = 5.0) -> None:
    """SIGKILL every rank still running; reap them (up to ``wait_s`` each)."""
    for rank in ranks:
        if rank.exitcode is None and rank.process.pid is not None:
            rank.process.kill()
    for rank in ranks:
        if rank.process.pid is not None and wait_s:
            rank.process.join(timeout=wait_s)


RECHECK_S = 1.0  # the longest the watch waits without looking at the exit codes


class Supervisor:
    """Wait for the ranks (see the module docstring); `run` returns rank 0's summary."""

    def __init__(self, ranks: list[Rank], stop: StopSignals, timeout_s: float) -> None:
        self.ranks, self.stop, self.timeout_s = ranks, stop, timeout_s
        self.summary: Any = None
        self.open = {rank.messages: rank for rank in ranks}  # pipes not at their end yet
        self.ended: list[Rank] = []  # the ranks that ended by themselves (not killed by us)

    def run(self) -> dict[str, Any] | None:
        try:
            self._watch()
            self.ended = [r for r in self.ranks if r.exitcode is not None]
        finally:
            kill(self.ranks)
        self._read()  # what the ranks sent before they were killed
        return self._outcome()

    def _watch(self) -> None:
        done_since: float | None = None
        while any(rank.exitcode is None for rank in self.ranks):
            deadline = self._deadline(done_since)
            timeout = RECHECK_S if deadline is None else max(0.0, deadline - time.monotonic())
            # A rank's sentinel closes only when every process holding it ends
            # (a child it started may inherit it): recheck the exit codes anyway.
            ready = wait(self._waitables(), min(timeout, RECHECK_S))
            if self.stop.wakeup in ready:
                self.stop.drain()
            self._read()
            if self.stop.received is None and self._failed():
                self._await_a_crash()
                return
            if deadline is not None and time.monotonic() >= deadline:
                return  # a rank hung after another finished, or after a stop
            if done_since is None and any(r.exitcode is not None for r in self.ranks):
                done_since = time.monotonic()

    def _await_a_crash(self) -> None:
        """A rank raised: was it a peer's end that it saw? A peer that exits on its
        own (a crash, ``exit`` while its process group unwinds) is reaped within
        moments of it, so a short wait names the cause, not the echo."""
        raised = [str(r.error[1]).lower() for r in self.ranks if r.error]
        echoes = raised and all(any(w in e for w in ECHO_WORDS) for e in raised)
        deadline = time.monotonic() + (ECHO_GRACE_S if echoes else PEER_GRACE_S)
        while True:
            quiet = [r for r in self.ranks if not r.error]
            if any(r.exitcode not in (None, 0, EXIT_STOPPED) for r in quiet):
                return
            running = [r.process.sentinel for r in quiet if r.exitcode is None]
            remaining = deadline - time.monotonic()
            if not running or remaining <= 0:
                return
            wait(running, remaining)
            self._read()

    def _deadline(self, done_since: float | None) -> float | None:
        if self.stop.received is not None:
            return self.stop.at + self.timeout_s
        return None if done_since is None else done_since + self.timeout_s

    def _waitables(self) -> list[Any]:
        running = [r.process.sentinel for r in self.ranks if r.exitcode is None]
        wakeup = [self.stop.wakeup] if self.stop.wakeup is not None else []
        return [*running, *self.open, *wakeup]

    def _read(self) -> None:
        """Take the messages that arrived (a rank's last one is sent before it exits)."""
        for conn, rank in list(self.open.items()):
            try:
                while conn.poll():
                    kind, payload = conn.recv()
                    if kind == "summary":
                        self.summary = payload
                    elif kind == "result":  # the Python API's: tensors, loaded without running code
                        self.summary = torch.load(io.BytesIO(payload), weights_only=True)
                    else:
                        rank.error = (kind, payload)
            except (EOFError, OSError):  # the rank's end is closed: nothing more comes
                del self.open[conn]

    def _failed(self) -> bool:
        return any(r.error or r.exitcode not in (None, 0, EXIT_STOPPED) for r in self.ranks)

    def _outcome(self) -> dict[str, Any] | None:
        raised = [r for r in self.ranks if r.error]
        if self.stop.received is not None:
            if self.summary is not None and not raised:
                return self.summary  # stopped cleanly after a step: the summary says so
            detail = f" (rank {raised[0].index}: {raised[0].error[1]})" if raised else ""
            raise RunStopped(self.stop.received, detail)
        inputs = [r for r in raised if r.error[0] == "input"]
        if inputs:  # the ranks' agreed verdict on the data, as it is
            raise RankInputError(inputs[0].error[1])
        # A rank that died without a word first: an error raised may only be its peer gone.
        died = [r for r in self.ended if not r.error and r.exitcode not in (0, EXIT_STOPPED)]
        if died:
            raise RunFailed(self._died_line(died[0]))
        if raised:
            raise RunFailed(f"rank {raised[0].index} failed: {raised[0].error[1]}")
        unfinished = [r for r in self.ranks if r not in self.ended]
        if unfinished:
            raise RunFailed(
                f"rank {unfinished[0].index} did not finish {self.timeout_s:.0f} s (timeout_s)"
                " after another rank had; it was killed"
            )
        return self.summary

    def _died_line(self, rank: Rank) -> str:
        tail = rank.stderr.tail() if rank.stderr is not None else ""
        said = f"; its stderr ended: {tail}" if tail else "; it wrote nothing to stderr"
        return f"rank {rank.index} {exit_text(rank.exitcode)}{said}"
