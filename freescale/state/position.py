"""Where a run is in its data, and what a run resumed at another world size reads.

A run of W ranks with local batch B consumes W * B samples per global step.
A checkpoint records the step it continues at, ``n``, and the samples
consumed before it, ``samples_seen`` (``n * W * B`` when every step ran at W;
a run resumed at another world size counts on from its own start). Resuming
at W' ranks (``batch_size`` is a model-defining key: B does not change):

- Steps. The run continues at global step ``n``: step numbers, lr schedules,
  the tables' update counts and the balancer's plans go on from there, and
  each step now holds W' * B samples.
- Samples. A source with ``starting_at`` (both built-in ones, a
  `freescale.data.stream.SampleStream`) continues its stream at sample
  ``samples_seen``: step ``s >= n`` reads positions from
  ``samples_seen + (s - n) * W' * B`` on, so nothing is skipped or read
  twice; for file data the epoch is ``samples_seen // N`` and the position
  in it ``samples_seen % N`` (N training samples). The summary says
  ``"data_position": "sample"``.
- A source with ``with_segments`` (``parquet-stream``: a stream per rank)
  is given the run's segments, ``((0, W_0), (n_1, W_1), ...)``: from global
  step ``n_k`` on, ``W_k`` ranks. The checkpoint records them (``segments``
  in the manifest; an older manifest: one segment at its world size), so a
  chain of resumes W -> W' -> W'' keeps its history. At another world size
  the source redeals the rest of its epochs to the new ranks
  (`freescale.data.stream_resume`): no sample of an epoch lost or repeated.
  The summary says ``"data_position": "redealt"`` and lists the segments.
- Any other source is asked for step ``n`` of the new world,
  ``batch(n, r, W', B)``: what that holds is the source's own definition
  (one that numbers its samples by ``s * W * B`` would skip or repeat some).
  The summary says ``"data_position": "step"``.

At W' = W all give exactly the batches of the uninterrupted run (the
segments do not change: a segment at the world size of the one before is
no new segment, and one that ran no step is dropped).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Segments = tuple[tuple[int, int], ...]  # (first global step, world size) of each


@dataclass(frozen=True)
class DataPosition:
    """A run's start in its data: global step ``step`` with ``samples``
    consumed before it, written by ``world_size`` ranks (0: a fresh start),
    the run's ``segments`` so far (``()``: one, ``((0, world_size),)``)."""

    step: int = 0
    samples: int = 0
    world_size: int = 0
    segments: Segments = ()

    def __post_init__(self) -> None:
        if min(self.step, self.samples, self.world_size) < 0:
            raise ValueError(f"a data position is >= 0, got {self}")
        if self.segments == ((0, self.world_size),):  # one spelling of the plain run
            object.__setattr__(self, "segments", ())

    def history(self) -> Segments:
        """The run's segments up to ``step``."""
        return self.segments or ((0, self.world_size),)

    def continued(self, world_size: int) -> Segments:
        """The segments of the run going on from ``step`` at ``world_size`` ranks."""
        return add_segment(self.history(), self.step, world_size)

    def samples_at(self, step: int, world_size: int, batch_size: int) -> int:
        """Samples consumed before ``step`` of a run of ``world_size`` ranks from
        here; before here, by the segments' own world sizes."""
        if step >= self.step:
            return self.samples + (step - self.step) * world_size * batch_size
        segments = self.history()
        ends = [first for first, _ in segments[1:]] + [self.step]
        return sum(max(0, min(step, end) - first) * world * batch_size
                   for (first, world), end in zip(segments, ends, strict=True))  # fmt: skip


def add_segment(segments: Segments, step: int, world_size: int) -> Segments:
    """``segments`` going on from ``step`` at ``world_size`` ranks: unchanged at
    the last segment's world size; a last segment that ran no step dropped."""
    out = list(segments)
    while out:
        first, world = out[-1]
        if world == world_size:
            return tuple(out)
        if first < step:
            break
        out.pop()
    return (*out, (step, world_size))


def resumed_source(source: Any, position: DataPosition, world_size: int) -> tuple[Any, str]:
    """(the source a run resumed at ``world_size`` ranks trains on, how it goes
    on: ``"sample"``, ``"redealt"`` or ``"step"``; module docstring)."""
    with_segments = getattr(source, "with_segments", None)
    if with_segments is not None:
        segments = position.continued(world_size)
        redealt = len(segments) > 1 and segments[-1][0] == position.step
        return with_segments(segments), "redealt" if redealt else "sample"
    starting_at = getattr(source, "starting_at", None)
    if starting_at is None:
        return source, "step"
    return starting_at(position.step, position.samples), "sample"


def resume_record(position: DataPosition, how: str, world_size: int) -> dict[str, Any]:
    """The summary's ``"resumed"`` entry."""
    out = {
        "step": position.step,
        "from_world_size": position.world_size,
        "samples_seen": position.samples,
        "data_position": how,
    }
    if how == "redealt":
        out["segments"] = [list(s) for s in position.continued(world_size)]
    return out
