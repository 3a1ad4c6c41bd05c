"""Per-step section timing: CUDA events on the compute stream, or wall clock on CPU.

A section's time is what the *compute stream* spends in it. For a blocking
collective (``work.wait()`` inside the section) that is exactly the exposed
communication: the compute stream can do nothing else meanwhile.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from freescale.jagged.ops import record_event

# Sections whose time is communication the compute stream waited on.
EXPOSED = {
    "preflight": "ids_a2a",  # id validity + counts exchange before the ids AllToAll
    "ids_a2a": "ids_a2a",
    "collision": "ids_a2a",  # freescale: split + collision marks exchange, with the ids
    "emb_a2a": "emb_a2a",
    "emb_a2a_collision": "emb_a2a",  # freescale: waiting for updated collision rows
    "grad_a2a": "grad_a2a",
    "grad_a2a_collision": "grad_a2a",  # freescale: the blocking collision gradients
    "dense_allreduce": "dense_allreduce",
    "meta": "meta",  # global candidate count of the step
    "balancer": "balancer",
}
CATEGORIES = ("ids_a2a", "emb_a2a", "grad_a2a", "dense_allreduce", "meta", "balancer")


class SectionTimer:
    """Collects named sections within one step; ``take()`` ends the step.

    ``timed``: the section names that are measured (None: all); any other
    section runs untimed, without its two events (each a host call per step)."""

    def __init__(self, device: torch.device, timed: frozenset[str] | None = None) -> None:
        self.cuda = device.type == "cuda"
        self.timed = timed
        self._open: list[tuple[str, object, object]] = []
        self.seq = 0  # marks are taken in stream order; a larger seq is later
        self.last_end: tuple[int, object] | None = None  # end of the latest section

    def _now(self) -> object:
        self.seq += 1
        if self.cuda:
            return record_event(timing=True)
        return time.perf_counter()

    @contextmanager
    def section(self, name: str) -> Iterator[None]:
        if self.timed is not None and name not in self.timed:
            yield
            return
        start = self._now()
        try:
            yield
        finally:
            end = self._now()
            self.last_end = (self.seq, end)
            self._open.append((name, start, end))

    def add_interval(self, name: str, start: object, end: object) -> None:
        """A section whose two ends were taken with `mark` (e.g. across hooks)."""
        self._open.append((name, start, end))

    def mark(self) -> object:
        return self._now()

    def seq_mark(self) -> tuple[int, object]:
        mark = self._now()
        return self.seq, mark

    def take(self) -> list[tuple[str, object, object]]:
        """End the step: its sections, to be read (`read_ms`) once its events are done."""
        taken, self._open = self._open, []
        return taken

    def read_ms(self, taken: list[tuple[str, object, object]]) -> dict[str, float]:
        """Total milliseconds per section name of ``taken``; waits for the CUDA events."""
        totals: dict[str, float] = defaultdict(float)
        for name, start, end in taken:
            if self.cuda:
                end.synchronize()  # type: ignore[attr-defined]
                totals[name] += start.elapsed_time(end)  # type: ignore[attr-defined]
            else:
                totals[name] += (end - start) * 1000.0  # type: ignore[operator]
        return dict(totals)


# The part of emb + grad exposure that collision rows cause (freescale mode):
# a sub-part of the categories above, reported beside them, never added to them.
COLLISION_PART = ("emb_a2a_collision", "grad_a2a_collision")
# The compute stream's time in host-tier reads and updates (`ShardStore.section`):
# the tier's exposed traffic, reported apart (it is part of compute_ms).
HOST_TIER_PART = ("host_lookup", "host_update")
# What a one-rank run times (it exchanges nothing): the data wait and the host tier.
ONE_RANK_TIMED = frozenset({"data", *HOST_TIER_PART})


def exposed_by_category(sections: dict[str, float]) -> dict[str, float]:
    out = dict.fromkeys(CATEGORIES, 0.0)
    for name, ms in sections.items():
        if name in EXPOSED:
            out[EXPOSED[name]] += ms
    return out
