"""``sync_debug = true``: name every place where the host waits for the GPU.

After warm-up, `torch.cuda.set_sync_debug_mode("warn")` makes each
synchronizing call (``.item()``, ``.tolist()``, a pageable copy, a stream
synchronize) raise a warning; each distinct call site is printed once to
stderr with the FreeScale frames that led to it. PyTorch does not flag waits
on an event, which is how FreeScale reads what it must read on the host (the
preflight counts, the collision split counts, the metrics one step late: a
pinned copy started early, then its event): those are counted by
`freescale.jagged.ops.wait_for_copy` whenever the copy was not done yet, i.e.
the host really waited, and printed per call site at the end. Every event or
stream ``synchronize`` (the timer's reads included) is also timed, and the
call sites that waited longest are printed with their total and mean wait.
Whether a wait left the GPU idle (nothing else queued) is for `freescale
trace` to say.
"""

from __future__ import annotations

import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from freescale.jagged.ops import BLOCKING_WAITS

MIN_WAIT_S = 2e-4  # shorter synchronize calls are bookkeeping, not waits


def _freescale_frames() -> list[str]:
    """The caller's FreeScale frames, outermost first (this module left out)."""
    return [
        f"{f.filename.split('freescale/')[-1]}:{f.lineno} {f.name}"
        for f in traceback.extract_stack()
        if "/freescale/" in f.filename and "sync_debug" not in f.filename
    ]


def _site() -> str:
    return " < ".join(reversed(_freescale_frames()[-3:])) or "outside freescale"


@contextmanager
def timed_waits() -> Iterator[dict[str, list[float]]]:
    """``{call site: [count, total s]}`` of event/stream synchronizes that waited."""
    waits: dict[str, list[float]] = {}
    originals = {cls: cls.synchronize for cls in (torch.cuda.Event, torch.cuda.Stream)}

    def timed(original):
        def synchronize(self) -> None:
            t0 = time.perf_counter()
            original(self)
            dt = time.perf_counter() - t0
            if dt >= MIN_WAIT_S:
                entry = waits.setdefault(_site(), [0, 0.0])
                entry[0] += 1
                entry[1] += dt

        return synchronize

    for cls, original in originals.items():
        cls.synchronize = timed(original)  # type: ignore[method-assign]
    try:
        yield waits
    finally:
        for cls, original in originals.items():
            cls.synchronize = original  # type: ignore[method-assign]


@contextmanager
def report_host_syncs(enabled: bool, rank: int) -> Iterator[None]:
    if not enabled or not torch.cuda.is_available():
        yield
        return
    seen: set[tuple[str, ...]] = set()
    before = BLOCKING_WAITS.copy()
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchronizing cuda operation" not in str(message).lower():
            previous(message, category, filename, lineno, file, line)
            return
        frames = tuple(_freescale_frames()[-5:])
        if frames not in seen:
            seen.add(frames)
            print(f"[rank {rank}] host sync: {message}\n    " + "\n    ".join(frames),
                  file=sys.stderr, flush=True)  # fmt: skip

    warnings.showwarning = show
    with warnings.catch_warnings(), timed_waits() as timed:
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = previous
    print(f"[rank {rank}] sync_debug: {len(seen)} distinct host-sync call site(s)",
          file=sys.stderr, flush=True)  # fmt: skip
    waits = dict(BLOCKING_WAITS - before)
    print(f"[rank {rank}] sync_debug: event waits that blocked (copy not done yet): "
          f"{waits or 'none'}", file=sys.stderr, flush=True)  # fmt: skip
    longest = sorted(timed.items(), key=lambda kv: -kv[1][1])[:8]
    for site, (count, total) in longest:
        ms = total * 1e3
        print(f"[rank {rank}] sync_debug: waited {ms:.1f} ms in {int(count)} call(s)"
              f" (mean {ms / count:.2f} ms) at {site}", file=sys.stderr, flush=True)  # fmt: skip
