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
- Any other source is asked for step ``n`` of the new world,
  ``batch(n, r, W', B)``: what that holds is the source's own definition
  (one that numbers its samples by ``s * W * B`` would skip or repeat some).
  The summary says ``"data_position": "step"``.

At W' = W both give exactly the batches of the uninterrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DataPosition:
    """A run's start in its data: global step ``step`` with ``samples``
    consumed before it, written by ``world_size`` ranks (0: a fresh start)."""

    step: int = 0
    samples: int = 0
    world_size: int = 0

    def __post_init__(self) -> None:
        if min(self.step, self.samples, self.world_size) < 0:
            raise ValueError(f"a data position is >= 0, got {self}")

    def samples_at(self, step: int, world_size: int, batch_size: int) -> int:
        """Samples consumed before ``step`` of a run of ``world_size`` ranks from here."""
        return self.samples + (step - self.step) * world_size * batch_size


def resumed_source(source: Any, position: DataPosition) -> tuple[Any, str]:
    """(the source the resumed run trains on, ``"sample"`` or ``"step"``): the
    source continued at ``position``'s sample if it can, else as it is."""
    starting_at = getattr(source, "starting_at", None)
    if starting_at is None:
        return source, "step"
    return starting_at(position.step, position.samples), "sample"


def resume_record(position: DataPosition, how: str) -> dict[str, Any]:
    """The summary's ``"resumed"`` entry."""
    return {
        "step": position.step,
        "from_world_size": position.world_size,
        "samples_seen": position.samples,
        "data_position": how,
    }
