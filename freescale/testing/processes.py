"""Run a command the way a user would, in a session of its own, and check by
pid that it leaves no process behind (Linux ``/proc``).

Every process the command starts (a launcher's ranks, torchrun's agent and
workers, their helpers) inherits its session, unless it makes a new one, so
the session's members after the command ended are exactly what it left
behind. Nothing here waits without a limit: a command still running at its
limit is SIGKILLed with its whole session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Finished:
    """A command's exit status, output, wall time and what it left running."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float
    ended_at: float  # time.monotonic() when it had ended
    left: list[int]  # pids of its session still alive after it ended (and the grace)

    @property
    def last_line(self) -> str:
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else ""


def _stat(pid: str) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...


def session_members(session: int) -> list[int]:
    """Live (not zombie) processes of ``session``."""
    members = []
    for entry in os.listdir("/proc"):
        fields = _stat(entry) if entry.isdigit() else None
        if fields and int(fields[3]) == session and fields[0] != "Z":
            members.append(int(entry))
    return sorted(members)


def children(parent: int) -> list[int]:
    """Live (not zombie) children of ``parent``."""
    found = []
    for entry in os.listdir("/proc"):
        fields = _stat(entry) if entry.isdigit() else None
        if fields and int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(entry))
    return sorted(found)


def run_session(
    cmd: list[str],
    limit_s: float,
    env: dict[str, str] | None = None,
    stdin: str | None = None,
    during: Callable[[subprocess.Popen], None] | None = None,
    grace_s: float = 5.0,
) -> Finished:
    """Run ``cmd`` (cwd: the repository) in a new session; ``during(proc)`` runs
    while it does (send it signals, kill its children). After it ended, its
    session gets ``grace_s`` to empty; what is still alive then is killed and
    listed in ``left``."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, text=True, start_new_session=True,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        if during is not None:
            during(proc)
        out, err = proc.communicate(
            input=stdin, timeout=max(0.1, limit_s - (time.monotonic() - start))
        )
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        err += f"\n[run_session: still running after {limit_s:.0f} s: killed]"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    ended_at = time.monotonic()
    deadline = time.monotonic() + grace_s
    while (left := session_members(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return Finished(proc.returncode, out, err, ended_at - start, ended_at, left)


def python(*args: str) -> list[str]:
    """``python args`` with this interpreter."""
    return [sys.executable, *args]
