"""A spawned rank's stderr: passed through to the launcher's, its last lines kept.

A rank that dies without a Python error (SIGKILL, a segfault, ``exit`` in a
library, an error while Python starts it) leaves only its exit status and
what it wrote to stderr. The launcher names both in its one-line error, so
each rank writes its stderr into a pipe of its own: a thread copies what
arrives to the launcher's stderr as it comes (the terminal shows what it
showed before) and keeps the last lines.

The rank's standard error is file descriptor 2 from the moment Python starts
in it (before any code of ours runs there), so the pipe is put on the
launcher's descriptor 2 just while the rank is started (`attached`): a
spawned process inherits it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

TAIL_BYTES = 4096  # what is kept of a rank's stderr (its last lines)
TAIL_LINES = 3  # lines quoted in the launcher's error
TAIL_CHARS = 400  # their length in that line, at most


class RankStderr:
    """The stderr pipe of one rank, copied to this process's stderr by a thread."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        self._out = _own_stderr()  # closed by the thread, so never reused under it
        self._tail = b""
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._copy, daemon=True, name="rank-stderr")
        self._thread.start()

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        """Descriptor 2 is this pipe while the block runs (start the rank in it)."""
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(self._write, 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)

    def started(self) -> None:
        """The rank holds the pipe now: only its end stays open (EOF when it exits)."""
        os.close(self._write)

    def _copy(self) -> None:
        while chunk := os.read(self._read, 65536):
            if self._out is not None:
                with contextlib.suppress(OSError):  # the launcher's stderr may be gone
                    os.write(self._out, chunk)
            with self._lock:
                self._tail = (self._tail + chunk)[-TAIL_BYTES:]
        os.close(self._read)
        if self._out is not None:
            os.close(self._out)

    def tail(self, wait_s: float = 1.0) -> str:
        """The last lines the rank wrote, on one line ("" when none); waits up to
        ``wait_s`` for the copy to reach the end (what a dying rank wrote last)."""
        self._thread.join(timeout=wait_s)  # (a child of the rank may hold the pipe open)
        with self._lock:
            text = self._tail.decode(errors="replace")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        joined = " | ".join(lines[-TAIL_LINES:])
        return joined if len(joined) <= TAIL_CHARS else "..." + joined[-TAIL_CHARS:]


def _own_stderr() -> int | None:
    """A descriptor of this process's stderr now (None: it has none)."""
    try:
        return os.dup(2)
    except OSError:
        return None
