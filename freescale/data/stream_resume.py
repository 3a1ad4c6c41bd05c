"""Per-rank streams over a run's segments, and the redeal when the world size changes.

A run is a list of segments ``((n_0 = 0, W_0), (n_1, W_1), ...)``: from
global step ``n_k`` on, ``W_k`` ranks (the checkpoint records it:
`freescale.state.position`). Rank ``r``'s stream in segment ``k`` is a
`RankStream`: the units carried over to it, then its shares of fresh epochs
dealt over ``W_k`` ranks. A unit ``(epoch, W, r, w, start)`` is window ``w``
of rank ``r``'s share of ``epoch`` at world size ``W`` (its samples in their
shuffled order) from sample ``start`` on. Segment 0 carries nothing and
starts fresh at epoch 0: the stream of a run that never changed size.

The redeal at step ``n_{k+1}``: each rank of segment ``k`` has read
``(n_{k+1} - n_k) * B`` samples of its stream. ``E`` is the largest epoch of
any rank's next sample. A rank's leftover is the rest of its stream up to
and including epoch ``E``: the rest of the unit it is in (``start`` moved
on), then its later units of epochs <= E (empty windows dropped). All
leftovers, sorted, are dealt round-robin to the ``W_{k+1}`` new ranks; a new
rank's stream is its units, then fresh epochs from ``E + 1`` on, dealt over
``W_{k+1}`` ranks. A unit carried again later keeps its key and moves its
``start``, so a chain of resumes composes.

Why no sample is lost or read twice in an epoch: at each segment's start,
the unread samples of every epoch <= E are exactly the carried units (each
once), and no sample of a later epoch has been read (a stream's epochs never
decrease); later epochs are dealt afresh. So over the whole run the samples
read with epoch tag ``e`` hold no repeat, and an epoch every rank has passed
was read whole. Epochs <= E may end at different steps on different ranks,
as they already do without a resume.
"""

from __future__ import annotations

import bisect
import copy
import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple, Self

Unit = tuple[int, int, int, int, int]  # (epoch, world size, rank, window, first sample)
Cursor = tuple[int, int, int, int]  # (carried units passed, fresh epoch, window, position)
Segments = tuple[tuple[int, int], ...]  # (first global step, world size) of each


class RankStream(NamedTuple):
    """A rank's stream in one segment: ``carried`` units, then its shares of
    fresh epochs ``epoch``, ``epoch + 1``, ... dealt over ``world`` ranks."""

    carried: tuple[Unit, ...]
    epoch: int
    world: int
    rank: int


def check_segments(segments: Sequence[Sequence[int]]) -> Segments:
    """``segments`` as (step, world size) pairs; ValueError unless the first
    starts at step 0, the steps increase and every world size is >= 1."""
    out = tuple((int(n), int(w)) for n, w in segments)
    steps = [n for n, _ in out]
    if not out or steps[0] != 0 or steps != sorted(set(steps)) or min(w for _, w in out) < 1:
        raise ValueError(f"segments must be (0, W), (n1 > 0, W1), ... with W >= 1, got {out}")
    return out


class SegmentedStream:
    """Mixin of a source that reads one stream per rank (`ParquetStreamSource`).

    The host provides ``spec``, ``windows(epoch, rank, world)`` (the windows
    of a fresh share), ``window_samples(epoch, rank, world, w)`` and the
    dicts ``_cursor`` and ``_plans`` (per-stream caches, keyed with the
    segments, so copies may share them).
    """

    segments: Segments | None = None  # None: a run at one world size, whichever asks
    spec: str
    _cursor: dict[tuple, Cursor]
    _plans: dict[tuple, list[list[RankStream]]]

    def with_segments(self, segments: Sequence[Sequence[int]]) -> Self:
        """A copy of this source for a run whose global steps ran as ``segments``."""
        out = copy.copy(self)
        out.segments = check_segments(segments)
        return out

    def rank_stream(
        self, step: int, rank: int, world_size: int, batch_size: int
    ) -> tuple[tuple, RankStream, int]:
        """(a cache key, ``rank``'s stream in the segment of ``step``, the position
        of ``step``'s first sample in it)."""
        segments = self.segments or ((0, world_size),)
        k = bisect.bisect_right([n for n, _ in segments], step) - 1
        first, world = segments[k]
        if world != world_size:
            raise ValueError(
                f"{self.spec}: step {step} of this run is at world size {world}, not {world_size}"
            )
        if k == 0:
            stream = RankStream((), 0, world, rank)
        else:
            plan = self._plans.get((segments, batch_size))
            if plan is None:
                plan = self._plans[(segments, batch_size)] = self._plan(segments, batch_size)
            stream = plan[k][rank]
        return (self.segments, k, world, rank), stream, (step - first) * batch_size

    def locate(self, q: int, key: tuple, stream: RankStream) -> tuple[Unit, int]:
        """(the unit holding position ``q`` of ``stream``, the position of its
        first sample); ``key`` keeps a cursor per stream for the next call."""
        at = self._cursor.get(key)
        cursor, unit, _ = self._find(stream, q, at if at is not None and at[3] <= q else None)
        self._cursor[key] = cursor
        return unit, cursor[3]

    def batch_epochs(self, step: int, rank: int, world_size: int, batch_size: int) -> list[int]:
        """The epoch of each sample of ``rank``'s batch at ``step`` (its negatives'
        seed; tests check each epoch is read whole, once)."""
        key, stream, first = self.rank_stream(step, rank, world_size, batch_size)
        return [self.locate(q, key, stream)[0][0] for q in range(first, first + batch_size)]

    # ---- walking a stream ------------------------------------------------------
    def _walk(self, stream: RankStream, at: Cursor | None = None) -> Iterator[tuple]:
        """(cursor, unit, samples) of each non-empty unit of ``stream`` from
        ``at`` (a cursor it yielded; None: the start) on. Endless: epochs repeat."""
        passed, epoch, start, first = at if at is not None else (0, stream.epoch, 0, 0)
        for i in range(passed, len(stream.carried)):
            unit = stream.carried[i]
            size = self.window_samples(unit[0], unit[2], unit[1], unit[3]) - unit[4]
            yield (i, epoch, 0, first), unit, size
            first += size
        i = len(stream.carried)
        while True:
            found = start > 0  # only a whole epoch without a sample is an error
            for w in range(start, len(self.windows(epoch, stream.rank, stream.world))):
                size = self.window_samples(epoch, stream.rank, stream.world, w)
                if size:
                    found = True
                    yield (i, epoch, w, first), (epoch, stream.world, stream.rank, w, 0), size
                    first += size
            if not found:
                raise ValueError(
                    f"{self.spec}: rank {stream.rank}/{stream.world}'s share holds no training "
                    "sample (histories too short for a target)"
                )
            epoch, start = epoch + 1, 0

    def _find(self, stream: RankStream, q: int, at: Cursor | None = None) -> tuple:
        """(cursor, unit, samples) of the unit holding position ``q``."""
        for cursor, unit, size in self._walk(stream, at):
            if q < cursor[3] + size:
                return cursor, unit, size
        raise AssertionError("unreachable: a stream is endless")

    def _plan(self, segments: Segments, batch_size: int) -> list[list[RankStream]]:
        """Every segment's rank streams (module docstring)."""
        world = segments[0][1]
        out = [[RankStream((), 0, world, r) for r in range(world)]]
        for (begin, _), (end, world) in itertools.pairwise(segments):
            out.append(self._redeal(out[-1], (end - begin) * batch_size, world))
        return out

    def _redeal(self, streams: list[RankStream], read: int, world: int) -> list[RankStream]:
        """The streams of ``world`` ranks taking over from ``streams``, each of
        which has read ``read`` samples."""
        at = [self._find(s, read) for s in streams]
        last = max(unit[0] for _, unit, _ in at)
        units: list[Unit] = []
        for stream, (cursor, unit, _) in zip(streams, at, strict=True):
            epoch, w_old, r_old, w, start = unit
            units.append((epoch, w_old, r_old, w, start + read - cursor[3]))
            for _, later, _ in itertools.islice(self._walk(stream, cursor), 1, None):
                if later[0] > last:
                    break
                units.append(later)
        units.sort()
        return [RankStream(tuple(units[j::world]), last + 1, world, j) for j in range(world)]
