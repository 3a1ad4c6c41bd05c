"""Input checks of every batch, on the host, agreed by all ranks before use.

A malformed batch on one rank used to fail that rank only (the others then
waited in a collective until the timeout) or, worse, train silently (offsets
that do not match their values still index *something*). Two parts:

- `find_problem` (in the loader, on the host, before the copy to the
  device): offsets well formed and matching their values (UIH, candidates,
  content; candidate offsets against the labels), ids inside their tables
  (items, actions, content), labels and dense features finite; then the
  ids the model looks up against the rows of the tables they hit (a model
  may size a table below the data's ids; `freescale.embedding.table_rows`).
  The first problem becomes six integers ``[code, part, local index, sample
  id, value, 0]``.
- `InputAgreement.check` (trainer thread, when the batch is taken): one
  tiny all-gather of those four integers over a gloo group - the same
  pattern as the embedding preflight - so that every rank raises the same
  ValueError, naming the rank, the sample and the step, before the batch
  reaches the balancer, the tables or the weights.

Before any batch, `check_all_rows` runs a source's own check of all its data
(``check_rows``, optional; `freescale.data.stream_check` for ``parquet-stream``),
shared between the ranks and agreed the same way: one ValueError line, the
same on every rank, before step 0.

Empty local batches (variable batch sizes make them legitimate) and samples
without history are valid input, not problems.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from freescale.comm.rank_text import broadcast_text, first_problem
from freescale.embedding.table_rows import TOO_SMALL, TableRows
from freescale.jagged.batch import CAND_IDS, CONTENT_IDS, UIH_ACTIONS, UIH_IDS, SampleBatch
from freescale.jagged.schema import DataSchema, Feature
from freescale.jagged.tensor import JaggedFeatures

OK, OFFSETS, ID_RANGE, NONFINITE, MISSING, DATA_ERROR, TABLE_ROWS = range(7)
_WIDTH = 6  # code, part, local index, sample id, value, extra

# What each part of a batch is called in messages, by index.
PARTS = (
    "uih offsets",
    "candidate offsets",
    "content offsets",
    "uih item id",
    "uih action id",
    "candidate item id",
    "content id",
    "label",
    "dense feature",
)


@dataclass(frozen=True)
class Limits:
    """Table sizes ids must stay below; ``extra``: the data's own id features
    (part ``len(PARTS) + i`` in problems is ``extra[i]``); ``tables``: the
    rows of the model's tables, by lookup feature (part ``i`` of a
    ``TABLE_ROWS`` problem is ``tables.features[i]``); ``raw_items``: item ids
    are the data's own (any int64, `freescale.jagged.schema.Feature`): only
    the tables they hit bound them."""

    num_items: int
    num_actions: int
    extra: tuple[Feature, ...] = ()
    tables: TableRows | None = None
    raw_items: bool = False

    @staticmethod
    def of(schema: DataSchema, tables: TableRows | None = None) -> Limits:
        extra = tuple(f for f in schema.extras() if f.bounded)
        raw = schema.get("uih", UIH_IDS).raw
        return Limits(schema.num_items, schema.num_actions, extra, tables, raw)

    def part_name(self, part: int) -> str:
        if part < len(PARTS):
            return PARTS[part]
        f = self.extra[part - len(PARTS)]
        return f"{f.level} feature {f.name!r}"


def _segment(offsets: Tensor, position: int) -> int:
    """Segment holding value ``position`` (offsets assumed well formed)."""
    return int(torch.searchsorted(offsets, position, right=True)) - 1


def _offsets(offsets: Tensor, total: int) -> tuple[int, int] | None:
    """(segment, value) of the first problem of ``offsets`` against ``total`` values."""
    if offsets.numel() == 0:
        return 0, 0
    if int(offsets[0]) != 0:
        return 0, int(offsets[0])
    lengths = offsets.diff()
    if lengths.numel() and bool((lengths < 0).any()):
        seg = int((lengths < 0).nonzero()[0])
        return seg, int(lengths[seg])
    if int(offsets[-1]) != total:
        return max(0, offsets.numel() - 2), int(offsets[-1]) - total
    return None


def _total(features: JaggedFeatures) -> int:
    """Number of values behind ``features``' offsets (its features' first dim)."""
    for t in features.features.values():
        return t.shape[0]
    return int(features.offsets[-1]) if features.offsets.numel() else 0


def _out_of_range(ids: Tensor, rows: int) -> int | None:
    """Position of the first id outside ``[0, rows)``."""
    if ids.numel() == 0:
        return None
    values = ids.numpy()  # host tensors; numpy's min/max: one fast pass, no thread pool
    if values.min() >= 0 and values.max() < rows:
        return None
    return int(np.flatnonzero((values < 0) | (values >= rows))[0])


def find_problem(
    batch: SampleBatch, limits: Limits, lookups: Callable[[SampleBatch], Any] | None = None
) -> list[int] | None:
    """The first problem of ``batch`` as ``[code, part, local index, sample id, value, 0]``;
    ``lookups(batch)``: the lookup features the model makes of it, checked
    against ``limits.tables`` once the data is found sound."""
    sample_ids = batch.sample_id
    n_cand = batch.num_candidates_total

    def at(code: int, part: int, sample: int, value: int) -> list[int]:
        sample = min(max(sample, 0), max(0, batch.batch_size - 1))
        sid = int(sample_ids[sample]) if batch.batch_size else -1
        return [code, part, sample, sid, value, 0]

    checks = [(0, batch.uih.offsets, _total(batch.uih)), (1, batch.candidates.offsets, n_cand)]
    for part, offsets, total in checks:
        bad = _offsets(offsets, total)
        if bad is not None:
            return at(OFFSETS, part, bad[0], bad[1])
    bad = _offsets(batch.content.offsets, _total(batch.content))
    if bad is not None:  # content segments are candidates: name the candidate's sample
        return at(OFFSETS, 2, _segment(batch.candidates.offsets, bad[0]), bad[1])
    items = not limits.raw_items  # raw item ids: any int64
    ranges = [
        *([(3, batch.uih, UIH_IDS, limits.num_items, batch.uih.offsets)] if items else []),
        (4, batch.uih, UIH_ACTIONS, limits.num_actions, batch.uih.offsets),
        *([(5, batch.candidates, CAND_IDS, limits.num_items, batch.candidates.offsets)]
          if items else []),
    ]  # fmt: skip
    for part, features, name, rows, offsets in ranges:
        if name not in features.features:
            continue
        ids = features[name]
        pos = _out_of_range(ids, rows)
        if pos is not None:
            return at(ID_RANGE, part, _segment(offsets, pos), int(ids[pos]))
    if items and CONTENT_IDS in batch.content.features:
        ids = batch.content[CONTENT_IDS]
        pos = _out_of_range(ids, limits.num_items)
        if pos is not None:
            cand = _segment(batch.content.offsets, pos)
            return at(ID_RANGE, 6, _segment(batch.candidates.offsets, cand), int(ids[pos]))
    for i, feature in enumerate(limits.extra):
        bad = _extra_problem(batch, feature)
        if bad is not None:
            return at(bad[0], len(PARTS) + i, bad[1], bad[2])
    finite = torch.isfinite(batch.labels)
    if not bool(finite.all()):
        cand = int((~finite).nonzero()[0])
        return at(NONFINITE, 7, _segment(batch.candidates.offsets, cand), 0)
    if batch.dense is not None:
        finite = torch.isfinite(batch.dense).all(dim=1)
        if not bool(finite.all()):
            return at(NONFINITE, 8, int((~finite).nonzero()[0]), 0)
    if lookups is not None and limits.tables is not None:
        return _table_problem(batch, limits.tables, lookups)
    return None


def _table_problem(
    batch: SampleBatch, tables: TableRows, lookups: Callable[[SampleBatch], Any]
) -> list[int] | None:
    try:
        features = lookups(batch)
    except ValueError:  # a contract mistake: taking the batch raises it on every rank
        return None
    bad = tables.first_beyond(features)
    return None if bad is None else [TABLE_ROWS, bad[0], 0, -1, bad[1], 0]


def _extra_problem(batch: SampleBatch, feature: Feature) -> tuple[int, int, int] | None:
    """(code, sample, value) of the first problem of a declared extra id feature."""
    level: JaggedFeatures = getattr(batch, feature.level)
    if feature.name not in level.features:
        return MISSING, 0, 0
    ids = level[feature.name]
    assert feature.rows is not None
    if ids.shape[0] != _total(level):
        return OFFSETS, 0, ids.shape[0] - _total(level)
    pos = _out_of_range(ids, feature.rows)
    if pos is None:
        return None
    seg = _segment(level.offsets, pos)  # uih, candidates: the sample; content: the candidate
    if feature.level == "content":
        seg = _segment(batch.candidates.offsets, seg)
    return ID_RANGE, seg, int(ids[pos])


def message(rank: int, step: int, row: Sequence[int], limits: Limits | None = None) -> str:
    """The one sentence every rank raises for ``rank``'s problem ``row``."""
    code, part, local, sid, value = row[:5]
    if code == TABLE_ROWS and limits is not None and limits.tables is not None:
        table = limits.tables.describe(part, value)
        return f"bad input on rank {rank}, step {step}: {table}: {TOO_SMALL}"
    where = f"bad input on rank {rank}, step {step}, sample {sid} (local index {local})"
    name = limits.part_name(part) if limits is not None else PARTS[part]
    if code == OFFSETS:
        return f"{where}: malformed {name} (start, negative length or overrun {value})"
    if code == MISSING:
        return f"{where}: the batch has no {name}, which the data's schema declares"
    if code == ID_RANGE:
        rows = ""
        if limits is not None:
            if part >= len(PARTS):
                top = limits.extra[part - len(PARTS)].rows
            else:
                top = limits.num_actions if part == 4 else limits.num_items
            rows = f", outside [0, {top})"
        return (
            f"{where}: {name} id {value}{rows}"
            if part >= len(PARTS)
            else f"{where}: {name} {value}{rows}"
        )
    return f"{where}: non-finite {name}"


class InputAgreement:
    """Every rank learns every rank's first input problem: one gloo all-gather per batch.

    ``lookups(batch)``: the lookup features the model makes of a batch, checked
    against ``limits.tables`` by `find` (the loader's check of each batch)."""

    def __init__(
        self, group: Any, rank: int, world: int, limits: Limits,
        lookups: Callable[[SampleBatch], Any] | None = None,
    ) -> None:  # fmt: skip
        self.group, self.rank, self.world, self.limits = group, rank, world, limits
        self.lookups = lookups

    def find(self, batch: SampleBatch) -> list[int] | None:
        """This rank's first problem of ``batch`` (on the host, in the loader)."""
        return find_problem(batch, self.limits, self.lookups)

    def check(self, problem: list[int] | None, step: int, error: str = "") -> None:
        """Raise the same ValueError on every rank if any rank's batch of ``step`` is bad
        (``error``: the source's own line, when it could not build the batch)."""
        row = torch.tensor(problem or [OK] * _WIDTH, dtype=torch.int64)
        if self.world > 1:
            rows = [torch.empty_like(row) for _ in range(self.world)]
            dist.all_gather(rows, row, group=self.group)
        else:
            rows = [row]
        if any(int(got[0]) == DATA_ERROR for got in rows):  # its text, from its rank
            text = first_problem(error, self.group, self.world) if self.world > 1 else error
            raise ValueError(text)
        for r, got in enumerate(rows):
            if int(got[0]) != OK:
                raise ValueError(message(r, step, got.tolist(), self.limits))


def check_all_rows(source: Any, group: Any, rank: int, world: int) -> None:
    """Run ``source.check_rows(rank, world)`` (when it has one) and raise the same
    ValueError on every rank for the first problem any rank found.

    ``check_rows`` returns an iterator with as many items on every rank (one per
    round of the check): None, or ``(key, line)`` of this rank's first problem.
    After each round the ranks all-gather ``[found, key, done]``; at the first
    round where any rank found one, every rank raises the line of the smallest
    key (ties: the lowest rank). A ValueError raised by ``check_rows`` is a
    problem with key -1."""
    check = getattr(source, "check_rows", None)
    if check is None:
        return
    rounds, done = None, False
    while True:
        found = None
        if not done:
            try:
                rounds = iter(check(rank, world)) if rounds is None else rounds
                found = next(rounds)
            except StopIteration:
                done = True
            except ValueError as e:
                found, done = (-1, str(e).splitlines()[0]), True
        key, line = found if found is not None else (0, "")
        row = torch.tensor([found is not None, key, done], dtype=torch.int64)
        if world > 1:
            rows = [torch.empty_like(row) for _ in range(world)]
            dist.all_gather(rows, row, group=group)
        else:
            rows = [row]
        table = torch.stack(rows)
        if bool(table[:, 0].any()):
            keys = torch.where(table[:, 0] > 0, table[:, 1], torch.iinfo(torch.int64).max)
            src = int(torch.argmin(keys))  # the first minimum: the lowest rank
            raise ValueError(broadcast_text(line, group, world, src))
        if bool(table[:, 2].all()):
            return
