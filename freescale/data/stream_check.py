"""Every row of a ``parquet-stream`` dataset checked before step 0, a row group at a time.

The stream checks a row when its window is read (`ParquetStreamSource._histories`,
the per-row code of `columnar._history`), which may be hours into a run and
on one rank only. This pass finds the same problems up front, with numpy on
whole row groups instead of Python per row, and reports the first one in
*piece order* (row groups numbered in file order) with the line the per-row
code would raise for that row: ``PATH: row group G, row R: WHY``.

What a row must satisfy, in the order the per-row code checks it (the first
failing check names the problem):

1. no column (``items``, the optional ``actions``/``timestamps``, the
   ``data.features`` columns, in that order) is a null list or holds a null;
2. every column is as long as ``items``;
3. actions in ``0..MAX_ACTIONS-1``;
4. no negative item, then no negative timestamp;
5. no negative feature value (features in order);
6. items below ``num_items``, actions below ``num_actions``, each feature below its ROWS.

Unsorted timestamps are not a problem: rows are sorted by them, stably. A row
group that every row passes is then checked for rows with more training
targets than a sample id holds (``2**16``; the stream would fail there).
A row group that cannot be decoded is its own problem (file and row group).

Work is split between ranks: rank ``r`` of ``W`` reads the pieces ``p`` with
``p % W == r``, one row group in memory at a time, each file opened once per
run of its pieces. `check_rounds` yields once per *round* (a run of ``W``-piece
strides of at least `ROUND_ROWS` rows over all ranks, the same rounds on every
rank): the caller agrees after each round (`freescale.pipeline.inputs.check_all_rows`)
and stops at the first round where a rank found a problem, so no rank checks
long past an error nor waits in a collective longer than a round.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from freescale.data.columnar import MAX_ACTIONS, _pyarrow
from freescale.data.readers import DataFormatError
from freescale.data.sequences import SequenceSampling

ROUND_ROWS = 200_000  # rows of all ranks between two agreements (about a second of reading)
MAX_TARGETS = 2**16  # training targets per row a sample id holds (`parquet_stream.ID_BITS`)


@dataclass(frozen=True)
class RowRules:
    """What a row is checked against (a `ParquetStreamSource`'s columns and limits)."""

    columns: list[str]  # items, the optional columns present, the features, in that order
    extra: list[str]  # the features
    num_items: int
    num_actions: int
    rows: dict[str, int]  # per feature: its table's rows
    sampling: SequenceSampling = field(default_factory=SequenceSampling)

    @staticmethod
    def of(source: Any) -> RowRules:
        return RowRules(
            list(source.files.columns),
            list(source.extra),
            source.num_items,
            source.num_actions,
            dict(source.rows),
            source.sampling,
        )


# ---- one batch of rows -------------------------------------------------------
@dataclass
class ListColumn:
    """A list column of a record batch as numpy: its offsets (from 0), values
    (nulls as 0) and where the nulls are (None: no null)."""

    offsets: np.ndarray
    values: np.ndarray
    null_rows: np.ndarray | None
    null_values: np.ndarray | None

    @staticmethod
    def of(array: Any) -> ListColumn:
        offsets = array.offsets.to_numpy().astype(np.int64)  # absolute into array.values
        values = array.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
        offsets -= offsets[0]
        null_values = None
        if values.null_count:
            null_values = values.is_null().to_numpy(zero_copy_only=False)
            values = values.fill_null(0)
        numbers = values.to_numpy(zero_copy_only=False)
        if numbers.dtype != np.uint64:  # uint64 stays: its values may not fit an int64
            numbers = numbers.astype(np.int64, copy=False)
        null_rows = array.is_null().to_numpy(zero_copy_only=False) if array.null_count else None
        return ListColumn(offsets, numbers, null_rows, null_values)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def row_of(self, flags: np.ndarray) -> int | None:
        """The row of the first flagged value (values are in row order)."""
        if not flags.any():
            return None
        first = int(np.argmax(flags))
        return int(np.searchsorted(self.offsets, first, side="right")) - 1

    def row(self, r: int) -> tuple[bool, np.ndarray, bool]:
        """(null list, its values, holds a null) of row ``r``."""
        lo, hi = int(self.offsets[r]), int(self.offsets[r + 1])
        null_value = self.null_values is not None and bool(self.null_values[lo:hi].any())
        null_row = self.null_rows is not None and bool(self.null_rows[r])
        return null_row, self.values[lo:hi], null_value


def _bad_values(name: str, values: np.ndarray, rules: RowRules) -> np.ndarray:
    """The values of column ``name`` that fail a value check (3.-6. of the module)."""
    if name == "items":
        top = rules.num_items
    elif name == "actions":
        top = min(MAX_ACTIONS, rules.num_actions)
    elif name == "timestamps":
        return values < 0
    else:
        top = rules.rows[name]
    return (values < 0) | (values >= top)


def batch_problem(batch: Any, rules: RowRules) -> tuple[int, str] | None:
    """(row in ``batch``, what is wrong) of its first bad row (module docstring), else None."""
    columns = {c: ListColumn.of(batch.column(c)) for c in rules.columns}
    items = columns["items"].lengths()
    first: list[int] = []
    for name, col in columns.items():
        if col.null_rows is not None and col.null_rows.any():
            first.append(int(np.argmax(col.null_rows)))
        if col.null_values is not None:
            first.append(col.row_of(col.null_values))  # type: ignore[arg-type]
        if name != "items":
            differ = col.lengths() != items
            if differ.any():
                first.append(int(np.argmax(differ)))
        row = col.row_of(_bad_values(name, col.values, rules))
        if row is not None:
            first.append(row)
    if not first:
        return None
    row = min(first)
    return row, _row_problem(columns, row, rules)


def _row_problem(columns: dict[str, ListColumn], r: int, rules: RowRules) -> str:
    """What is wrong with row ``r``: the first failing check, worded as the
    per-row code words it (`columnar._history`, `ParquetStreamSource._check_range`)."""
    rows = {c: col.row(r) for c, col in columns.items()}
    for c, (null_row, _, null_value) in rows.items():
        if null_row:
            return f"{c} is empty (null)"
        if null_value:
            return f"{c} value None is not an integer"
    n = rows["items"][1].size
    for c, (_, values, _) in rows.items():
        if values.size != n:
            return f"{c} has {values.size} values, items has {n}"
    values = {c: v for c, (_, v, _) in rows.items()}
    if "actions" in values:
        actions = values["actions"]
        bad = (actions < 0) | (actions >= MAX_ACTIONS)
        if bad.any():
            return f"action {int(actions[np.argmax(bad)])} is outside 0..{MAX_ACTIONS - 1}"
    for c, word in (("items", "item"), ("timestamps", "timestamp")):
        if c in values and values[c].size and values[c].min() < 0:
            return f"negative {word} {int(values[c].min())}"
    for c in rules.extra:
        if values[c].size and values[c].min() < 0:
            return f"{c} value {int(values[c].min())} is negative"
    limits = [("items", rules.num_items, "data.num_items / freescale.num_items")]
    limits.append(("actions", rules.num_actions, "freescale.num_actions"))
    limits += [(c, rules.rows[c], f"data.features {c}") for c in rules.extra]
    for c, top, setting in limits:
        if c in values and values[c].size and values[c].max() >= top:
            return f"{c} value {int(values[c].max())} is outside 0..{top - 1} ({setting})"
    raise AssertionError(f"row {r} was flagged but passes every check")  # a bug of this module


def target_problem(items: np.ndarray, rules: RowRules) -> tuple[int, str] | None:
    """(row, what is wrong) of the first row of ``items`` lengths with more training
    targets than a sample id holds (`parquet_stream.split_sample_id`)."""
    s = rules.sampling
    count = np.maximum(0, (items - s.holdout - s.num_positives + s.stride - 1) // s.stride)
    if s.samples_per_user:
        count = np.minimum(count, s.samples_per_user)
    over = np.flatnonzero(count > MAX_TARGETS)
    if not over.size:
        return None
    r = int(over[0])
    return r, (
        f"items has {int(items[r])} events, {int(count[r])} training targets: a sample id "
        f"holds {MAX_TARGETS} per row (set data.samples_per_user or data.target_stride)"
    )


# ---- row groups ----------------------------------------------------------------
class _Reader:
    """Row groups of one file after another, each file opened once per run of pieces."""

    def __init__(self, files: Any) -> None:
        self.files, self.file, self.handle, self.parquet = files, -1, None, None

    def read(self, piece: int) -> Any:
        pa = _pyarrow()
        import pyarrow.parquet as pq

        k = int(self.files.piece_file[piece])
        path, group = self.files.paths[k], int(self.files.piece_group[piece])
        try:
            if k != self.file:
                self.close()
                self.file = k
                self.handle = self.files.filesystem.open_input_file(path)
                self.parquet = pq.ParquetFile(self.handle)
            assert self.parquet is not None
            return self.parquet.read_row_group(group, columns=self.files.columns)
        except (pa.ArrowException, OSError) as e:
            self.close()
            raise DataFormatError(path, f"row group {group}", str(e).splitlines()[0]) from None

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()
        self.file, self.handle, self.parquet = -1, None, None


def piece_problem(table: Any, path: str, group: int, first: int, rules: RowRules) -> str | None:
    """The one line of a row group's first problem (``first``: its first row's
    index in the file), else None."""
    offset, targets = 0, None
    for batch in table.to_batches():
        found = batch_problem(batch, rules)
        if found is not None:
            row, why = found
            return str(DataFormatError(path, f"row group {group}, row {first + offset + row}", why))
        if targets is None:
            items = ListColumn.of(batch.column("items")).lengths()
            hit = target_problem(items, rules)
            if hit is not None:
                targets = (offset + hit[0], hit[1])
        offset += batch.num_rows
    if targets is None:
        return None
    return str(DataFormatError(path, f"row group {group}, row {first + targets[0]}", targets[1]))


def rounds(files: Any, world_size: int, round_rows: int = ROUND_ROWS) -> list[tuple[int, int]]:
    """Piece ranges ``[lo, hi)`` (multiples of ``world_size``, the last one cut at
    the piece count) of at least ``round_rows`` rows each: the same on every rank."""
    n = int(files.piece_rows.size)
    out, lo, rows = [], 0, 0
    for start in range(0, n, world_size):
        rows += int(files.piece_rows[start : start + world_size].sum())
        if rows >= round_rows:
            out.append((lo, min(n, start + world_size)))
            lo, rows = start + world_size, 0
    if lo < n:
        out.append((lo, n))
    return out


def check_rounds(
    source: Any, rank: int, world_size: int, round_rows: int = ROUND_ROWS
) -> Iterator[tuple[int, str] | None]:
    """Check rank ``rank``'s pieces (``p % world_size == rank``), yielding once per
    round (`rounds`): None, or (piece, line) of this rank's first problem (then stop)."""
    files, rules = source.files, RowRules.of(source)
    reader = _Reader(files)
    try:
        for lo, hi in rounds(files, world_size, round_rows):
            found = None
            for piece in range(lo + rank, hi, world_size):  # lo: a multiple of world_size
                path = files.paths[int(files.piece_file[piece])]
                group, first = int(files.piece_group[piece]), int(files.piece_first[piece])
                try:
                    line = piece_problem(reader.read(piece), path, group, first, rules)
                except DataFormatError as e:
                    line = str(e)
                if line is not None:
                    found = (piece, line)
                    break
            yield found
            if found is not None:
                return
    finally:
        reader.close()


def first_problem(source: Any, round_rows: int = ROUND_ROWS) -> str | None:
    """The first problem of all the data in one process (piece order), else None."""
    for found in check_rounds(source, 0, 1, round_rows):
        if found is not None:
            return found[1]
    return None
