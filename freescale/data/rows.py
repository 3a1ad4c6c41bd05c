"""The rows of the one-row-per-user layout, checked a batch of rows at a time with numpy.

One checker for every path that reads such rows out of core: the stream
(`freescale.data.parquet_stream`, and its check before step 0,
`freescale.data.stream_check`), ``freescale data split``
(`freescale.data.split`) and the held-out rows of a split directory
(`freescale.data.split_source`). It finds the first bad row and words its
problem as the per-row code of the in-memory reader does
(`columnar._history`, then `ParquetStreamSource._check_range`), so the line
is the same whichever path meets the row: ``PATH: row group G, row R: WHY``.

What a row must satisfy, in the order the per-row code checks it (the first
failing check names the problem):

1. no column (``items``, the optional ``actions``/``timestamps``, the
   extra columns, in that order) is a null list or holds a null;
2. every column is as long as ``items``;
3. actions in ``0..MAX_ACTIONS-1``;
4. no negative item, then no negative timestamp;
5. no negative extra value (columns in order);
6. items below ``num_items``, actions below ``num_actions``, each extra
   column below its ROWS (when known: ``data split`` carries columns it
   does not size).

Raw item ids (``raw_items``, a dynamic item table's: `freescale.data.ids`)
are any int64: 4. and 6. do not apply to them; an unsigned column's value past
int64 is then the problem, at 6.'s place.

Unsorted timestamps are not a problem: readers sort rows by them, stably.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from freescale.data.columnar import MAX_ACTIONS
from freescale.data.readers import INT64
from freescale.data.sequences import SequenceSampling

# where the item and action limits come from, as the messages name them
STREAM_LIMITS = ("data.num_items / freescale.num_items", "freescale.num_actions")
SIGNED = (("items", "item"), ("timestamps", "timestamp"))  # columns that hold no negative


@dataclass(frozen=True)
class RowRules:
    """What a row is checked against (a `ParquetStreamSource`'s columns and limits)."""

    columns: list[str]  # items, the optional columns present, the extra ones, in that order
    extra: list[str]  # the extra columns (features)
    num_items: int
    num_actions: int
    rows: dict[str, int]  # per extra column: its table's rows (absent: no upper bound)
    sampling: SequenceSampling = field(default_factory=SequenceSampling)
    limits_from: tuple[str, str] = STREAM_LIMITS
    raw_items: bool = False  # items: any int64 (``num_items`` then bounds nothing)

    @staticmethod
    def of(source: Any) -> RowRules:
        raw = bool(getattr(source, "raw", False))
        return RowRules(
            list(source.files.columns),
            list(source.extra),
            0 if raw else source.num_items,  # (a raw stream's count needs a pass: not asked)
            source.num_actions,
            dict(source.rows),
            source.sampling,
            raw_items=raw,
        )


@dataclass
class ListColumn:
    """A list column as numpy: its offsets (from 0), values (nulls as 0) and
    where the nulls are (None: no null)."""

    offsets: np.ndarray
    values: np.ndarray
    null_rows: np.ndarray | None
    null_values: np.ndarray | None

    @staticmethod
    def of(array: Any) -> ListColumn:
        if hasattr(array, "chunks"):  # a table's column
            array = array.combine_chunks()
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


def list_columns(data: Any, names: list[str]) -> dict[str, ListColumn]:
    """The columns ``names`` of a record batch or a table, in that order."""
    return {c: ListColumn.of(data.column(c)) for c in names}


def first_bad_row(columns: dict[str, ListColumn], rules: RowRules) -> tuple[int, str] | None:
    """(row, what is wrong) of the first row of ``columns`` (`list_columns`, items
    first) that fails a check (module docstring), else None."""
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
    return row, _why(columns, row, rules)


def _bad_values(name: str, values: np.ndarray, rules: RowRules) -> np.ndarray:
    """The values of column ``name`` that fail a value check (3.-6. of the module)."""
    if name == "items" and rules.raw_items:
        return values > INT64[1] if values.dtype == np.uint64 else np.zeros(values.size, bool)
    if name == "items":
        top = rules.num_items
    elif name == "actions":
        top = min(MAX_ACTIONS, rules.num_actions)
    elif name == "timestamps" or name not in rules.rows:
        return values < 0
    else:
        top = rules.rows[name]
    return (values < 0) | (values >= top)


def _why(columns: dict[str, ListColumn], r: int, rules: RowRules) -> str:
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
    signed = (("timestamps", "timestamp"),) if rules.raw_items else SIGNED
    for c, word in signed:
        if c in values and values[c].size and values[c].min() < 0:
            return f"negative {word} {int(values[c].min())}"
    for c in rules.extra:
        if values[c].size and values[c].min() < 0:
            return f"{c} value {int(values[c].min())} is negative"
    if rules.raw_items and values["items"].size and values["items"].max() > INT64[1]:
        return f"item {int(values['items'].max())} does not fit in int64"
    item_limit, action_limit = rules.limits_from
    limits = [("items", rules.num_items, item_limit)] if not rules.raw_items else []
    limits.append(("actions", rules.num_actions, action_limit))
    limits += [(c, rules.rows[c], f"data.features {c}") for c in rules.extra if c in rules.rows]
    for c, top, setting in limits:
        if c in values and values[c].size and values[c].max() >= top:
            return f"{c} value {int(values[c].max())} is outside 0..{top - 1} ({setting})"
    raise AssertionError(f"row {r} was flagged but passes every check")  # a bug of this module
