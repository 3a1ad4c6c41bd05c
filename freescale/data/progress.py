"""Progress of long work over data (``data convert``, ``data split``, ``data stats``).

On a terminal a tqdm bar (the count done, the rate, the time left where the
total is known) that redraws in place; anywhere else (a log file, CI, a
pipe) a plain line at most every ``every`` seconds, so a log holds a few
lines rather than a bar's thousands of redraws. A caller's ``say`` gets the
plain lines.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


class Progress:
    """``progress(msg, done=..., total=...)`` after each piece of work;
    ``force``: always shown as a plain line (the first and the last)."""

    def __init__(
        self,
        say: Callable[[str], None] | None = None,
        every: float = 2.0,
        stream: TextIO | None = None,
        unit: str = "it",
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = say is None and _is_terminal(self.stream)
        self.say = say or (lambda msg: print(msg, file=self.stream, flush=True))
        self.every, self.last, self.unit = every, time.monotonic(), unit
        self.bar: Any = None

    def __call__(
        self, msg: str, force: bool = False, done: int | None = None, total: int | None = None
    ) -> None:
        if self.terminal and done is not None:
            self._draw(msg, done, total)
            return
        now = time.monotonic()
        if force or now - self.last >= self.every:
            self.close()
            self.say(msg)
            self.last = now

    def _draw(self, msg: str, done: int, total: int | None) -> None:
        from tqdm import tqdm

        if self.bar is None or self.bar.total != total:
            self.close()
            self.bar = tqdm(total=total, file=self.stream, unit=self.unit, dynamic_ncols=True)
        self.bar.set_description_str(msg, refresh=False)
        self.bar.update(done - self.bar.n)
        if total is not None and done >= total:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
