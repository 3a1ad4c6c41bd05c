"""Columnar user histories through ``pyarrow`` (optional: ``pip install freescale[data]``).

One row per user, list columns:

- ``items`` (required): the item ids, in chronological order unless
  ``timestamps`` is given (then rows are sorted by it, stably);
- ``actions`` (optional): non-negative integers below ``MAX_ACTIONS``;
- ``timestamps`` (optional): integers;
- the columns named by ``features`` (the data option
  ``data.features=NAME:LEVEL[:ROWS],...``): the data's own id features,
  one value per event (as long as ``items`` in every row), non-negative
  integers below ROWS (when not given: the column's largest value + 1).
  Level ``uih``: the feature of each history event, a named feature of the
  batch's ``uih`` beside the item ids. Level ``candidates``: an attribute of
  the *item* (its category, its seller), so it is known for every candidate,
  the sampled negatives too; every event of an item must then carry the same
  value. One column may be named at both levels (``category:uih,category:candidates``);
- any other column (a user id, say) is ignored.

Parquet files hold real list columns; in a CSV file each list is one field
of space-separated integers (``"12 7 33"``). Ids follow the rules of the
text readers: non-negative integers, remapped in order of first appearance
(``raw``: any int64, kept as they are).
Feature values are not remapped: they index the feature's table as written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from freescale.data.readers import (
    INT64,
    DataFormatError,
    SequenceDataset,
    UserHistory,
    _Vocab,
    check_file,
    keep_raw_ids,
)
from freescale.jagged.schema import DataSchema, Feature

LIST_COLUMNS = ("items", "actions", "timestamps")
MAX_ACTIONS = 1024  # an action table larger than this is almost surely a wrong column
FEATURE_LEVELS = ("uih", "candidates", "content")
FEATURES_HELP = "data.features=NAME:LEVEL[:ROWS],... (LEVEL: uih, candidates or content)"
CONTENT_SEP = ";"  # a CSV field of content lists: "1 2;3;;4 5" (one list per event)


def parse_features(spec: str | Sequence[str] | None) -> tuple[tuple[str, str, int | None], ...]:
    """``"NAME:LEVEL[:ROWS],..."`` (or a list of ``NAME:LEVEL[:ROWS]``) ->
    ``(name, level, rows)`` triples; one-line ValueError for a malformed one."""
    if spec is None or spec == "":
        return ()
    if isinstance(spec, str):
        parts = spec.split(",")
    elif isinstance(spec, list | tuple) and all(isinstance(p, str) for p in spec):
        parts = list(spec)
    else:
        raise ValueError(f"{FEATURES_HELP}; got {spec!r}")
    out: list[tuple[str, str, int | None]] = []
    standard = {f.key for f in DataSchema.standard(1, 1).features}
    for part in parts:
        fields = part.strip().split(":")
        name, level = fields[0].strip(), fields[1].strip() if len(fields) > 1 else ""
        rows_text = fields[2].strip() if len(fields) == 3 else None
        if not name or level not in FEATURE_LEVELS or len(fields) > 3:
            raise ValueError(f"{FEATURES_HELP}; got {part.strip()!r}")
        rows = None
        if rows_text is not None:
            if not (rows_text.isascii() and rows_text.isdigit()) or int(rows_text) < 1:
                raise ValueError(f"data.features {part.strip()!r}: ROWS must be an integer >= 1")
            rows = int(rows_text)
        if name in LIST_COLUMNS or Feature(name, level).key in standard:
            raise ValueError(f"data.features: {name!r} is a standard column, not an extra feature")
        if any(n == name and lv == level for n, lv, _ in out):
            raise ValueError(f"data.features names {name}:{level} twice")
        if any(n == name and r != rows for n, _, r in out):
            raise ValueError(f"data.features: column {name!r} is given two different ROWS")
        if any(n == name and "content" in (lv, level) for n, lv, _ in out):
            raise ValueError(
                f"data.features: column {name!r} at level content holds a list per event: "
                "name it at that level only"
            )
        out.append((name, level, rows))
    return tuple(out)


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


def read_columns(
    path: str | Path,
    fmt: str | None = None,
    features: str | Sequence[str] | None = None,
    ids: np.ndarray | None = None,
    raw: bool = False,
) -> SequenceDataset:
    """A Parquet file, or a CSV file with space-separated lists (``fmt``
    ``"parquet"`` or ``"csv"``; by default the file's suffix decides);
    ``features``: the extra columns to carry (`parse_features`); ``ids``: a map
    to remap item ids through, ``raw``: keep them as written
    (`freescale.data.readers.read_sasrec`)."""
    wanted = parse_features(features)
    path = check_file(path)
    pa = _pyarrow()
    csv_file = (fmt or path.suffix.lower().lstrip(".")) == "csv"
    extra = list(dict.fromkeys(name for name, _, _ in wanted))  # columns, in order, once
    try:
        if csv_file:
            table = pa.csv.read_csv(
                path,
                convert_options=pa.csv.ConvertOptions(
                    column_types={c: pa.string() for c in (*LIST_COLUMNS, *extra)}
                ),
            )
        else:
            table = pa.parquet.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataFormatError(path, None, str(e).splitlines()[0]) from None
    for c in ("items", *extra):
        if c not in table.column_names:
            raise DataFormatError(path, None, f"no {c!r} column (columns: {table.column_names})")
    nested = [name for name, level, _ in wanted if level == "content"]
    flat = [c for c in extra if c not in nested]
    read = [c for c in LIST_COLUMNS if c in table.column_names] + extra
    columns = {c: table.column(c).to_pylist() for c in read}
    vocab, users = _Vocab(path, ids), []
    first_row = 2 if csv_file else 1  # a CSV's row 1 is its header: rows are line numbers
    for r in range(table.num_rows):
        where = f"row {r + first_row}"
        lists = {
            c: _as_ints(path, where, c, v[r], csv_file, raw and c == "items")
            for c, v in columns.items()
            if c not in nested
        }
        n = len(lists["items"])
        contents = {c: _as_lists(path, where, c, columns[c][r], csv_file, n) for c in nested}
        users.append(_history(path, where, lists, vocab, flat, contents, raw))
    item_ids = vocab.raw_ids()
    dataset = SequenceDataset(
        users,
        item_ids.size,
        1 + max((int(h.actions.max(initial=0)) for h in users), default=0),
        path.name,
        item_ids=item_ids,
    )
    if wanted:  # by row: a raw id's row is its catalogue position
        _add_features(path, dataset, wanted, item_ids.tolist(), first_row)
    return keep_raw_ids(dataset) if raw else dataset


def _history(
    path: Path | str,
    where: str,
    lists: dict[str, list[int]],
    vocab: _Vocab | None,
    extra: list[str],
    contents: dict[str, list[list[int]]] | None = None,
    raw: bool = False,
) -> UserHistory:
    """One row: its columns checked, as one user's history in time order
    (``vocab``: how raw item ids are remapped; None keeps them as given;
    ``contents``: the content-level columns, a list per event; ``raw``: items
    are any int64, negative ones too)."""
    items = lists["items"]
    n = len(items)
    for c, values in {**lists, **(contents or {})}.items():
        if len(values) != n:
            raise DataFormatError(path, where, f"{c} has {len(values)} values, items has {n}")
    actions = lists.get("actions", [0] * n)
    bad = [a for a in actions if not 0 <= a < MAX_ACTIONS]
    if bad:
        raise DataFormatError(path, where, f"action {bad[0]} is outside 0..{MAX_ACTIONS - 1}")
    signs = [("timestamp", lists.get("timestamps", []))]
    for name, values in ([] if raw else [("item", items)]) + signs:
        if any(v < 0 for v in values):
            raise DataFormatError(path, where, f"negative {name} {min(values)}")
    wide = [v for v in items if not INT64[0] <= v <= INT64[1]]
    if wide:
        raise DataFormatError(path, where, f"item {wide[0]} does not fit in int64")
    for c in extra:
        if any(v < 0 for v in lists[c]):
            raise DataFormatError(path, where, f"{c} value {min(lists[c])} is negative")
    if vocab is None:
        ids = np.asarray(items, dtype=np.int64).reshape(n)
    else:
        ids = np.fromiter((vocab(i, where) for i in items), np.int64, n)
    stamps = np.asarray(lists.get("timestamps", range(n)), dtype=np.int64).reshape(n)
    order = np.argsort(stamps, kind="stable") if "timestamps" in lists else np.arange(n)
    return UserHistory(
        ids[order],
        np.asarray(actions, dtype=np.int64).reshape(n)[order],
        stamps[order],
        {c: np.asarray(lists[c], dtype=np.int64).reshape(n)[order] for c in extra},
        _content_lists(path, where, contents or {}, order),
    )


def _content_lists(
    path: Path | str, where: str, contents: dict[str, list[list[int]]], order: np.ndarray
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each content column as (length per event, values), events in ``order``;
    the columns share one length per event (one content segment per candidate)."""
    out = {}
    for c, per_event in contents.items():
        lengths = np.fromiter((len(x) for x in per_event), np.int64, len(per_event))
        if out:
            first, (given, _) = next(iter(out.items()))
            differ = np.flatnonzero(lengths[order] != given)
            if differ.size:
                k = int(order[differ[0]])
                raise DataFormatError(
                    path, where, f"{c} has {lengths[k]} values for event {k + 1}, {first} has "
                    f"{given[differ[0]]} (content columns share one list length per event)",
                )  # fmt: skip
        values = [v for k in order.tolist() for v in per_event[k]]
        if any(v < 0 for v in values):
            raise DataFormatError(path, where, f"{c} value {min(values)} is negative")
        out[c] = (lengths[order], np.asarray(values, dtype=np.int64))
    return out


def _add_features(
    path: Path,
    dataset: SequenceDataset,
    wanted: tuple[tuple[str, str, int | None], ...],
    raw_ids: list[int],
    first_row: int,
) -> None:
    """Size, check and attach the extra features (``uih``: per event, already
    on the histories; ``candidates``: one value per item)."""
    lengths = np.array([h.items.size for h in dataset.users], dtype=np.int64)
    row_of = np.repeat(np.arange(lengths.size), lengths) + first_row  # per event, in row order
    items = np.concatenate([h.items for h in dataset.users] or [np.zeros(0, np.int64)])
    out = []
    for name, level, rows in wanted:
        if level == "content":
            out.append(_add_content(path, dataset, name, rows, items, row_of, raw_ids))
            continue
        values = np.concatenate(
            [h.features[name] for h in dataset.users] or [np.zeros(0, np.int64)]
        )
        if rows is None:
            rows = int(values.max(initial=0)) + 1
        over = np.flatnonzero(values >= rows)
        if over.size:
            k = over[0]
            raise DataFormatError(
                path,
                f"row {row_of[k]}",
                f"{name} value {values[k]} is outside 0..{rows - 1} (data.features {name}:{rows})",
            )
        out.append(Feature(name, level, rows))
        if level == "candidates":
            dataset.item_features[name] = _per_item(path, name, items, values, row_of, raw_ids)
    for h in dataset.users:  # only the uih-level columns stay on the histories
        h.features = {n: h.features[n] for n, lv, _ in wanted if lv == "uih"}
        h.content = {}
    dataset.features = tuple(out)


def _add_content(
    path: Path,
    dataset: SequenceDataset,
    name: str,
    rows: int | None,
    items: np.ndarray,
    row_of: np.ndarray,
    raw_ids: list[int],
) -> Feature:
    """The content column ``name`` as ``item_content[name]`` (the list every
    event of an item carries, by item id), its values checked against ROWS."""
    empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
    held = [h.content[name] for h in dataset.users] or [empty]
    lengths = np.concatenate([lengths for lengths, _ in held])
    values = np.concatenate([v for _, v in held])
    rows = int(values.max(initial=0)) + 1 if rows is None else rows
    over = np.flatnonzero(values >= rows)
    if over.size:
        k = int(np.searchsorted(np.cumsum(lengths), over[0], side="right"))  # its event
        bad = values[over[0]]
        raise DataFormatError(
            path,
            f"row {row_of[k]}",
            f"{name} value {bad} is outside 0..{rows - 1} (data.features {name}:{rows})",
        )
    starts = np.concatenate([[0], np.cumsum(lengths)])
    first: dict[int, int] = {}
    for k, item in enumerate(items.tolist()):
        f = first.setdefault(item, k)
        mine, theirs = values[starts[k] : starts[k + 1]], values[starts[f] : starts[f + 1]]
        if f != k and not np.array_equal(mine, theirs):
            raise DataFormatError(
                path, f"row {row_of[k]}", f"{name} {mine.tolist()} for item {raw_ids[item]}, "
                f"which has {name} {theirs.tolist()} in row {row_of[f]} (a content-level "
                "feature is one list per item)",
            )  # fmt: skip
    per_item = np.zeros(len(raw_ids), dtype=np.int64)
    firsts = np.fromiter(first.values(), np.int64, len(first))
    seen = np.fromiter(first.keys(), np.int64, len(first))
    per_item[seen] = lengths[firsts]
    offsets = np.concatenate([[0], np.cumsum(per_item)])
    table = np.zeros(int(offsets[-1]), dtype=np.int64)
    for item, f in first.items():
        table[offsets[item] : offsets[item + 1]] = values[starts[f] : starts[f + 1]]
    dataset.item_content[name] = (offsets, table)
    return Feature(name, "content", rows)


def _per_item(
    path: Path,
    name: str,
    items: np.ndarray,
    values: np.ndarray,
    row_of: np.ndarray,
    raw_ids: list[int],
) -> np.ndarray:
    """``table[item]``: the value every event of ``item`` carries (one per item)."""
    table = np.zeros(len(raw_ids), dtype=np.int64)
    seen, first = np.unique(items, return_index=True)
    table[seen] = values[first]
    differ = np.flatnonzero(table[items] != values)
    if differ.size:
        k, item = differ[0], items[differ[0]]
        was = first[np.searchsorted(seen, item)]
        raise DataFormatError(
            path,
            f"row {row_of[k]}",
            f"{name} {values[k]} for item {raw_ids[item]}, which has {name} {values[was]} in "
            f"row {row_of[was]} (a candidates-level feature is one value per item)",
        )
    return table


def _as_lists(
    path: Path | str, where: str, column: str, value: Any, from_text: bool, n: int
) -> list[list[int]]:
    """A content column's field: a list of integer lists (a CSV field: lists of
    space-separated integers joined by ``CONTENT_SEP``; empty with no event)."""
    if value is None:
        raise DataFormatError(path, where, f"{column} is empty (null)")
    if from_text:
        parts = value.split(CONTENT_SEP) if (value.strip() or n) else []
        return [_as_ints(path, where, column, p, True) for p in parts]
    if not isinstance(value, list):
        raise DataFormatError(path, where, f"{column} is not a list column")
    for v in value:
        if not isinstance(v, list):
            raise DataFormatError(
                path, where, f"{column} value {v!r} is not a list (content: a list per event)"
            )
    return [_as_ints(path, where, column, v, False) for v in value]


def _as_ints(
    path: Path | str, where: str, column: str, value: Any, from_text: bool, signed: bool = False
) -> list[int]:
    """A list field's integers (``signed``: a leading ``-`` allowed in text)."""
    if value is None:
        raise DataFormatError(path, where, f"{column} is empty (null)")
    if from_text:
        parts = value.split()
        for p in parts:
            digits = p[1:] if signed and p.startswith("-") else p
            if not (digits.isascii() and digits.isdigit()):
                kind = "an integer" if signed else "an integer >= 0"
                raise DataFormatError(path, where, f"{column} value {p!r} is not {kind}")
        return [int(p) for p in parts]
    if not isinstance(value, list):
        raise DataFormatError(path, where, f"{column} is not a list column")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, int | np.integer):
            raise DataFormatError(path, where, f"{column} value {v!r} is not an integer")
        out.append(int(v))
    return out
