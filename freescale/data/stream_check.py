"""Every row of a ``parquet-stream`` dataset checked before step 0, a row group at a time.

The stream checks a row when its window is read (`ParquetStreamSource._histories`,
the per-row code of `columnar._history`), which may be hours into a run and
on one rank only. This pass finds the same problems up front, with numpy on
whole row groups instead of Python per row, and reports the first one in
*piece order* (row groups numbered in file order) with the line the per-row
code would raise for that row: ``PATH: row group G, row R: WHY``.

The rules are `freescale.data.rows`' (one checker for the stream and
``data split``). A row group that every row passes is then checked for rows
with more training targets than a sample id holds (``2**16``; the stream
would fail there). A row group that cannot be decoded is its own problem
(file and row group).

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
from typing import Any

import numpy as np

from freescale.data.columnar import _pyarrow
from freescale.data.readers import DataFormatError
from freescale.data.rows import RowRules, first_bad_row, list_columns

ROUND_ROWS = 200_000  # rows of all ranks between two agreements (about a second of reading)
MAX_TARGETS = 2**16  # training targets per row a sample id holds (`parquet_files.ID_BITS`)


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
        columns = list_columns(batch, rules.columns)
        found = first_bad_row(columns, rules)
        if found is not None:
            row, why = found
            return str(DataFormatError(path, f"row group {group}, row {first + offset + row}", why))
        if targets is None:
            hit = target_problem(columns["items"].lengths(), rules)
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
