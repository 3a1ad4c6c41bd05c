"""``freescale data split``: the leave-one-out split of ``parquet-stream`` data, out of core.

SRC is data in the ``parquet-stream`` layout (a file, a directory, a glob or
a pyarrow URL; `freescale.data.parquet_stream`); DST a local directory:

- ``DST/train/``: every user's history without its last two events (a user
  with fewer than 3 events: an empty list), one row per SRC row, in SRC order;
- ``DST/validation/``: one row per user with at least 3 events: the history
  up to and including the second-to-last event, the row's last event is its
  target; the list column ``later_items`` holds the user's last item (the
  test target), which the evaluation negatives avoid like every item the
  user has;
- ``DST/test/``: the same users, the whole history, the last event the target;
- ``DST/_split.json``: what was written (counts, ``num_items``...), written
  last: a directory without it is an interrupted split.

This is the in-memory protocol (`freescale.data.sequences`): evaluated users
are those with ``holdout + 1`` = 3 events or more; validation user ``j`` (the
``j``-th row over the files in name order) is evaluated user ``j`` there.
Training on ``train/`` with ``holdout`` 0 gives exactly the training targets
of the whole histories with ``holdout`` 2, and its item counts are the
popularity baseline's. ``parquet-stream:DST`` reads it all
(`freescale.data.split_source`).

Out of core: one input row group at a time (read, checked, sorted by
``timestamps``, cut, appended to the three outputs), so memory is bounded by
a row group. SRC file ``k`` becomes ``part-0000k.parquet`` of each output;
``train`` keeps SRC's row groups. Every list column of SRC (lists of
integers, one per event) is cut with the events; other columns
(``user_id``) are copied per row. Rows are checked by the stream's checker
(`freescale.data.rows`: no null, equal list lengths, no negative id, items
below ``num_items``, actions below ``num_actions``), one line naming the
file, row group and row. ``num_items`` / ``num_actions``: SRC's metadata
``freescale.num_items`` / ``freescale.num_actions``, else the options (the
stream's defaults for actions); every output file's metadata carries them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from freescale.data.columnar import MAX_ACTIONS, _pyarrow
from freescale.data.ids import LAYOUT_IDS, copy_maps
from freescale.data.parquet_files import (
    OPTIONAL,
    PART,
    Files,
    check_output,
    clear_output,
    list_array,
    list_files,
    metadata_int,
    scan_files,
)
from freescale.data.progress import Progress
from freescale.data.readers import DataFormatError
from freescale.data.rows import RowRules, first_bad_row, list_columns

HOLDOUT = 2  # leave-one-out: the validation and the test event
PARTS = {"train": "train", "valid": "validation", "test": "test"}  # split -> directory
MARKER = "_split.json"
LATER = "later_items"  # validation rows: the items after the target (the test item)
FORMAT = "freescale-split/1"
OWNED = {*PARTS.values(), MARKER, LAYOUT_IDS}
LIMITS = ("--num-items / freescale.num_items", "--num-actions / freescale.num_actions")


def join(spec: str, name: str) -> str:
    """``spec/name`` for a local path or a URL."""
    return f"{spec.rstrip('/')}/{name}" if "://" in spec else str(Path(spec) / name)


def read_marker(spec: str) -> dict[str, Any] | None:
    """The ``_split.json`` of ``spec`` when it is a split directory, else None."""
    if any(c in spec for c in "*?[") and "://" not in spec:
        return None
    pa = _pyarrow()
    import pyarrow.fs as pafs

    try:
        if "://" in spec:
            filesystem, root = pafs.FileSystem.from_uri(spec)
        else:
            filesystem, root = pafs.LocalFileSystem(), str(Path(spec).absolute())
        path = f"{root.rstrip('/')}/{MARKER}"
        if filesystem.get_file_info(path).type != pafs.FileType.File:
            return None
        with filesystem.open_input_stream(path) as f:
            text = f.read().decode()
    except (pa.ArrowException, OSError, ValueError):
        return None  # not a readable split: the stream's own checks say why
    try:
        marker = json.loads(text)
    except ValueError:
        raise DataFormatError(
            path, None, "not a JSON file written by freescale data split"
        ) from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise DataFormatError(path, None, f"not a {FORMAT} marker (freescale data split)")
    return marker


def split(
    src: str,
    dst: str | Path,
    num_items: int | None = None,
    num_actions: int | None = None,
    force: bool = False,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write the split of ``src`` to ``dst`` (module docstring); the summary in ``_split.json``."""
    pa = _pyarrow()
    import pyarrow.parquet as pq

    spec = src.removeprefix("parquet-stream:")
    if read_marker(spec) is not None:
        raise ValueError(f"data split: {spec} is already a split (it has {MARKER})")
    filesystem, paths = list_files(spec)
    with filesystem.open_input_file(paths[0]) as f:
        schema = pq.read_schema(f)
    standard = {"items", *OPTIONAL, LATER}
    extra = [n for n in schema.names if n not in standard and _is_list(schema.field(n).type)]
    files = scan_files(spec, extra)
    part = files.metadata.get("freescale.split")
    if part:
        raise ValueError(f"data split: {paths[0]} is the {part} part of a split already")
    _check_apart(spec, dst)
    num_items = _setting(files, "num_items", num_items, "--num-items", None)
    default_actions = MAX_ACTIONS if "actions" in files.columns else 1
    num_actions = _setting(files, "num_actions", num_actions, "--num-actions", default_actions)
    out = check_output(dst, OWNED.__contains__, force, "data split")
    clear_output(out, OWNED.__contains__)
    for name in PARTS.values():
        (out / name).mkdir()
    metadata = {
        **files.metadata,
        "freescale.num_items": str(num_items),
        "freescale.num_actions": str(num_actions),
    }
    rules = RowRules(files.columns, extra, num_items, num_actions, {}, limits_from=LIMITS)
    totals = dict.fromkeys(("users", "eval_users", "users_dropped", "events", "train_events"), 0)
    progress, pieces, done = Progress(say, unit="row group"), len(files.piece_rows), 0
    for k, path in enumerate(files.paths):
        writers = {}
        try:
            with filesystem.open_input_file(path) as f:
                source = pq.ParquetFile(f)
                schemas = {
                    split_name: _out_schema(
                        source.schema_arrow, split_name, {**metadata, "freescale.split": name}
                    )
                    for split_name, name in PARTS.items()
                }
                for split_name, name in PARTS.items():
                    target = str(out / name / PART.format(k))
                    writers[split_name] = pq.ParquetWriter(target, schemas[split_name])
                first = 0
                for g in range(source.metadata.num_row_groups):
                    table = source.read_row_group(g)
                    where = (path, g, first)
                    cut = _cut(table, where, rules, schemas)
                    for split_name, part_table in cut.items():
                        if part_table.num_rows:
                            writers[split_name].write_table(part_table)
                    _count(totals, table, cut)
                    first += table.num_rows
                    done += bool(table.num_rows)
                    progress(
                        f"data split: {done}/{pieces} row groups, {totals['users']} users, "
                        f"{totals['eval_users']} evaluated",
                        done=done,
                        total=pieces,
                    )
        except (pa.ArrowException, OSError) as e:
            raise DataFormatError(path, None, str(e).splitlines()[0]) from None
        finally:
            for w in writers.values():
                w.close()
    summary = {
        "format": FORMAT,
        "protocol": "leave-one-out",
        "holdout": HOLDOUT,
        "source": src,
        "files": len(files.paths),
        "row_groups": pieces,
        "num_items": num_items,
        "num_actions": num_actions,
        "columns": [*files.columns],
        **totals,
    }
    copy_maps(spec, out)  # the raw ids of SRC's rows, once, for the stream on DST
    tmp = out / f".{MARKER}.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, out / MARKER)
    progress(
        f"data split: {done}/{pieces} row groups, {totals['users']} users, "
        f"{totals['eval_users']} evaluated: done",
        force=True,
    )
    return {**summary, "dst": str(out)}


def _is_list(t: Any) -> bool:
    pa = _pyarrow()
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _check_apart(spec: str, dst: str | Path) -> None:
    """Neither of SRC and DST inside the other (a later scan of SRC would read the
    split; ``--force`` on DST would remove SRC)."""
    if "://" in spec or any(c in spec for c in "*?["):
        return
    a, b = Path(spec).resolve(), Path(dst).resolve()
    if a == b or a in b.parents or b in a.parents:
        raise ValueError(f"data split: SRC {spec} and DST {dst} must not contain each other")


def _setting(files: Files, key: str, given: int | None, option: str, default: int | None) -> int:
    value = metadata_int(files, key, None)
    if value is not None and given is not None and given != value:
        raise ValueError(
            f"data split: {option} {given} but {files.paths[0]} has freescale.{key}={value}"
        )
    value = value if value is not None else given if given is not None else default
    if value is None:
        raise ValueError(
            f"data split: {files.paths[0]} has no freescale.{key} metadata: give {option}"
        )
    if value < 1:
        raise ValueError(f"data split: {option} must be >= 1, got {value}")
    return value


def _out_schema(schema: Any, split_name: str, metadata: dict[str, str]) -> Any:
    pa = _pyarrow()
    out = schema.remove_metadata()
    if split_name == "valid":
        out = out.append(pa.field(LATER, out.field("items").type))
    return out.with_metadata(metadata)


def _count(totals: dict[str, int], table: Any, cut: dict[str, Any]) -> None:
    import pyarrow.compute as pc

    users, evaluated = table.num_rows, cut["test"].num_rows
    totals["users"] += users
    totals["eval_users"] += evaluated
    totals["users_dropped"] += users - evaluated
    for key, part in (("events", "test"), ("train_events", "train")):
        lengths = pc.list_value_length(cut[part].column("items"))
        totals[key] += int(pc.sum(lengths).as_py() or 0)
    totals["events"] += _dropped_events(table, evaluated)


def _dropped_events(table: Any, evaluated: int) -> int:
    """Events of the users not evaluated (fewer than 3: in no output but train's empty row)."""
    import pyarrow.compute as pc

    if evaluated == table.num_rows:
        return 0
    lengths = pc.list_value_length(table.column("items")).to_numpy(zero_copy_only=False)
    return int(lengths[lengths < HOLDOUT + 1].sum())


def _cut(
    table: Any,
    where: tuple[str, int, int],
    rules: RowRules,
    schemas: dict[str, Any],
) -> dict[str, Any]:
    """One row group -> its train, validation and test tables."""
    pa = _pyarrow()
    path, group, first = where
    columns = list_columns(table, rules.columns)
    found = first_bad_row(columns, rules)
    if found is not None:
        row, why = found
        raise DataFormatError(path, f"row group {group}, row {first + row}", why)
    lists = {
        c: (col.lengths(), col.values.astype(np.int64, copy=False)) for c, col in columns.items()
    }
    lengths = lists["items"][0]
    row_of = np.repeat(np.arange(lengths.size), lengths)
    if "timestamps" in lists:  # events in time order within each row (stable), as the stream
        stamps = lists["timestamps"][1]
        if not np.all((np.diff(stamps) >= 0) | (np.diff(row_of) != 0)):
            order = np.argsort(stamps, kind="stable")
            order = order[np.argsort(row_of[order], kind="stable")]
            lists = {c: (n, values[order]) for c, (n, values) in lists.items()}
    n_of = np.repeat(lengths, lengths)
    pos = np.arange(n_of.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    evaluated = np.flatnonzero(lengths >= HOLDOUT + 1)
    keep = {
        "train": (pos < n_of - HOLDOUT, np.maximum(lengths - HOLDOUT, 0)),
        "valid": ((pos < n_of - 1) & (n_of > HOLDOUT), lengths[evaluated] - 1),
        "test": (n_of > HOLDOUT, lengths[evaluated]),
    }
    out = {}
    for split_name, (mask, kept) in keep.items():
        schema = schemas[split_name]
        arrays = []
        for name in table.column_names:
            field_type = schema.field(name).type
            if name in lists:
                values = lists[name][1][mask]
                arrays.append(_typed_list(kept, values, field_type))
            elif split_name == "train":
                arrays.append(table.column(name))
            else:
                arrays.append(table.column(name).take(pa.array(evaluated)))
        if split_name == "valid":
            last = (pos == n_of - 1) & (n_of > HOLDOUT)
            ones = np.ones(evaluated.size, dtype=np.int64)
            arrays.append(_typed_list(ones, lists["items"][1][last], schema.field(LATER).type))
        out[split_name] = pa.Table.from_arrays(arrays, schema=schema)
    return out


def _typed_list(lengths: np.ndarray, values: np.ndarray, list_type: Any) -> Any:
    """``values`` cut by ``lengths`` as a list array of ``list_type`` (SRC's own)."""
    return list_array(lengths, values, list_type.value_type).cast(list_type)
