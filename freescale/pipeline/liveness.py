"""Liveness of a run: ranks die with their launcher, stop cleanly on SIGTERM,
and a rank that stops responding is named in the error.

- **No orphans.** `die_with_parent` asks the kernel to SIGKILL this process
  when its parent dies (Linux ``PR_SET_PDEATHSIG``; a polling thread
  elsewhere), so killing the launcher, even with SIGKILL, ends every rank.
- **SIGTERM = finish the step.** `Liveness` turns SIGTERM into a flag. The
  ranks agree on it through the per-step metrics gather (one more number in
  a collective that runs anyway), so all of them stop after the same step,
  write a checkpoint if configured, print the summary and exit 143.
- **Named stuck rank.** Every rank writes a heartbeat (wall time and step)
  into the rendezvous store once a second from a helper thread. A
  collective that times out (after ``timeout_s``) is explained by
  `explain_timeout`: the ranks whose heartbeat is stale are frozen or dead,
  and the ranks at the lowest step are behind.

The store lives in the launcher process (or the torchrun agent), not in a
rank, so a frozen rank never takes the heartbeats down with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

EXIT_STOPPED = 143  # 128 + SIGTERM: the shell's code for "terminated", here after a clean stop
HEARTBEAT_S = 1.0
STALE_S = 4.0  # a heartbeat this old: the rank is frozen or dead (beats come every second)
_PR_SET_PDEATHSIG = 1
_stopped = False  # this process stopped early on SIGTERM (signals are per process)


def was_stopped() -> bool:
    """Whether a trainer in this process stopped early on SIGTERM (exit with 143)."""
    return _stopped


def mark_stopped() -> None:
    global _stopped
    _stopped = True


def die_with_parent(expected_parent: int | None = None) -> None:
    """SIGKILL this process when its parent exits (no orphaned ranks)."""
    parent = expected_parent if expected_parent is not None else os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if os.getppid() != parent:  # the parent died before prctl took effect
                    os._exit(1)
                return

    def watch() -> None:  # portable fallback: poll the parent
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def gloo_group(timeout_s: float) -> Any:
    """A new gloo group with the run's collective timeout (new groups default to 30 min)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))


def attempt_store(store: Any) -> Any:
    """``store`` with this torchrun attempt's keys apart from earlier attempts'.

    torchrun restarts the workers against the same store server (its agent's),
    where the keys of the attempt before would be read as this one's: gloo
    connects to the dead ranks' addresses (a connect timeout), heartbeats look
    fresh. Outside torchrun (no restart count) the store is used as it is.
    """
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return store if attempt is None else dist.PrefixStore(f"freescale/attempt-{attempt}/", store)


def _store_client(timeout_s: float) -> Any:
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    try:
        timeout = timedelta(seconds=timeout_s)
        return attempt_store(dist.TCPStore(addr, int(port), is_master=False, timeout=timeout))
    except (RuntimeError, ValueError):  # no store reachable: run without heartbeats
        return None


class Liveness:
    """SIGTERM flag + heartbeat thread of one rank (see the module docstring)."""

    def __init__(self, rank: int, world: int, timeout_s: float) -> None:
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.step = 0
        self.stop_requested = False
        self._stop = threading.Event()
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._store = _store_client(10.0) if world > 1 else None
        self._thread = None
        if self._store is not None:
            self._thread = threading.Thread(target=self._beat, daemon=True, name="heartbeat")
            self._thread.start()

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.stop_requested = True

    def _beat(self) -> None:
        key = f"freescale/hb/{self.rank}"
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a missed beat is only a missed beat
                self._store.set(key, f"{time.time():.3f} {self.step}")
            self._stop.wait(HEARTBEAT_S)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * HEARTBEAT_S)
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def heartbeats(self) -> dict[int, tuple[float, int] | None]:
        """Every rank's last heartbeat (wall time, step); None when unreadable."""
        beats: dict[int, tuple[float, int] | None] = {}
        for r in range(self.world):
            try:
                t, s = self._store.get(f"freescale/hb/{r}").decode().split()
                beats[r] = (float(t), int(s))
            except Exception:
                beats[r] = None
        return beats

    def explain_timeout(self, error: BaseException) -> str | None:
        """A one-line cause for a timed-out collective, naming the stuck rank(s)."""
        if self._store is None or not _looks_like_timeout(error):
            return None
        now, stale_after = time.time(), STALE_S
        beats = self.heartbeats()
        parts = []
        for r, beat in beats.items():
            if r == self.rank:
                continue
            if beat is None:
                parts.append(f"rank {r} never sent a heartbeat")
            elif now - beat[0] > stale_after:
                parts.append(
                    f"rank {r} is unresponsive (no heartbeat for {now - beat[0]:.0f} s,"
                    f" last at step {beat[1]})"
                )
        if not parts:
            steps = {r: b[1] for r, b in beats.items() if b is not None}
            low = min(steps.values(), default=self.step)
            behind = [r for r, s in steps.items() if s == low and s < max(steps.values())]
            parts = [f"rank {r} is behind (step {low})" for r in behind] or [
                "every rank is alive; a rank may be waiting in a different collective"
            ]
        return (
            f"rank {self.rank}: a collective timed out after {self.timeout_s:.0f} s"
            f" (timeout_s) at step {self.step}: " + "; ".join(parts)
        )


def _looks_like_timeout(error: BaseException | None) -> bool:
    """A timed-out collective, possibly wrapped (e.g. raised in the loader thread)."""
    while error is not None:
        text = str(error).lower()
        if isinstance(error, RuntimeError) and ("timed out" in text or "timeout" in text):
            return True
        error = error.__cause__
    return False
