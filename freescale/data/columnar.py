"""Columnar user histories through ``pyarrow`` (optional: ``pip install freescale[data]``).

One row per user, list columns:

- ``items`` (required): the item ids, in chronological order unless
  ``timestamps`` is given (then rows are sorted by it, stably);
- ``actions`` (optional): non-negative integers below ``MAX_ACTIONS``;
- ``timestamps`` (optional): integers;
- any other column (a user id, say) is ignored.

Parquet files hold real list columns; in a CSV file each list is one field
of space-separated integers (``"12 7 33"``). Ids follow the rules of the
text readers: non-negative integers, remapped in order of first appearance.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from freescale.data.readers import DataFormatError, SequenceDataset, _dataset, _Vocab, check_file

LIST_COLUMNS = ("items", "actions", "timestamps")
MAX_ACTIONS = 1024  # an action table larger than this is almost surely a wrong column


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.csv
        import pyarrow.parquet
    except ImportError:
        raise ValueError(
            "reading Parquet or list-CSV files needs pyarrow: pip install 'freescale[data]'"
        ) from None
    return pyarrow


def read_columns(path: str | Path, fmt: str | None = None) -> SequenceDataset:
    """A Parquet file, or a CSV file with space-separated lists (``fmt``
    ``"parquet"`` or ``"csv"``; by default the file's suffix decides)."""
    path = check_file(path)
    pa = _pyarrow()
    csv_file = (fmt or path.suffix.lower().lstrip(".")) == "csv"
    try:
        if csv_file:
            table = pa.csv.read_csv(
                path,
                convert_options=pa.csv.ConvertOptions(
                    column_types={c: pa.string() for c in LIST_COLUMNS}
                ),
            )
        else:
            table = pa.parquet.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataFormatError(path, None, str(e).splitlines()[0]) from None
    if "items" not in table.column_names:
        raise DataFormatError(path, None, f"no 'items' column (columns: {table.column_names})")
    columns = {c: table.column(c).to_pylist() for c in LIST_COLUMNS if c in table.column_names}
    vocab, users = _Vocab(), {}
    first_row = 2 if csv_file else 1  # a CSV's row 1 is its header: rows are line numbers
    for r in range(table.num_rows):
        where = f"row {r + first_row}"
        lists = {c: _as_ints(path, where, c, v[r], csv_file) for c, v in columns.items()}
        items = lists["items"]
        n = len(items)
        for c, values in lists.items():
            if len(values) != n:
                raise DataFormatError(path, where, f"{c} has {len(values)} values, items has {n}")
        actions = lists.get("actions", [0] * n)
        bad = [a for a in actions if not 0 <= a < MAX_ACTIONS]
        if bad:
            raise DataFormatError(path, where, f"action {bad[0]} is outside 0..{MAX_ACTIONS - 1}")
        for name, values in (("item", items), ("timestamp", lists.get("timestamps", []))):
            if any(v < 0 for v in values):
                raise DataFormatError(path, where, f"negative {name} {min(values)}")
        stamps = lists.get("timestamps", range(n))
        events = [(vocab(i), a, t) for i, a, t in zip(items, actions, stamps, strict=True)]
        if "timestamps" in lists:
            events.sort(key=lambda e: e[2])
        users[r] = events
    return _dataset(users, len(vocab.index), path.name)


def _as_ints(path: Path, where: str, column: str, value: Any, from_text: bool) -> list[int]:
    if value is None:
        raise DataFormatError(path, where, f"{column} is empty (null)")
    if from_text:
        parts = value.split()
        for p in parts:
            if not (p.isascii() and p.isdigit()):
                raise DataFormatError(path, where, f"{column} value {p!r} is not an integer >= 0")
        return [int(p) for p in parts]
    if not isinstance(value, list):
        raise DataFormatError(path, where, f"{column} is not a list column")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise DataFormatError(path, where, f"{column} value {v!r} is not an integer")
        out.append(int(v))
    return out
