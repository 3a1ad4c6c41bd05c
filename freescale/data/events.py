"""One row per event -> one row per user: ``freescale data convert events:PATH DST``.

Interaction logs are often kept one row per event: ``user_id``, ``item_id``,
``timestamp`` and an optional ``action`` (integers), each file sorted by
``user_id`` and a user's events in one file (a log partitioned and sorted by
user). A user found in two files becomes two rows (not checked: that would
hold every user id in memory). This writes the ``parquet-stream`` layout out of core, one
input row group at a time: output file k holds input file k's users, in
their order, one row each (``user_id``; ``items``, ``actions``,
``timestamps`` as lists, events sorted by timestamp, stably), with row groups
of ``row_group`` users. Ids stay as given (``parquet-stream`` reads them
so): a first pass over the columns finds ``freescale.num_items`` (the
largest item id + 1) and ``freescale.num_actions``, written as metadata.

Problems are one line naming the file (and row group and row): a missing or
non-integer column, a null, a negative id, rows not sorted by ``user_id``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from freescale.data.columnar import _pyarrow
from freescale.data.parquet_files import PART, list_array, list_files
from freescale.data.readers import DataFormatError

COLUMNS = ("user_id", "item_id", "timestamp")
OPTIONAL = ("action",)
FLUSH_EVENTS = 4_000_000  # events held before whole users are written out


def _open(filesystem: Any, path: str) -> Any:
    pa = _pyarrow()
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(filesystem.open_input_file(path))
    except (pa.ArrowException, OSError) as e:
        raise DataFormatError(path, None, str(e).splitlines()[0]) from None


def _columns(path: str, parquet: Any) -> list[str]:
    pa = _pyarrow()
    schema = parquet.schema_arrow
    for c in COLUMNS:
        if c not in schema.names:
            raise DataFormatError(path, None, f"no {c!r} column (columns: {schema.names})")
    read = [*COLUMNS, *(c for c in OPTIONAL if c in schema.names)]
    for c in read:
        if not pa.types.is_integer(schema.field(c).type):
            raise DataFormatError(
                path, None, f"column {c!r} is {schema.field(c).type}, not integers"
            )
    return read


def _group(path: str, parquet: Any, g: int, read: list[str]) -> dict[str, np.ndarray]:
    pa = _pyarrow()
    try:
        table = parquet.read_row_group(g, columns=read)
    except (pa.ArrowException, OSError) as e:
        raise DataFormatError(path, f"row group {g}", str(e).splitlines()[0]) from None
    out = {}
    for c in read:
        column = table.column(c)
        if column.null_count:
            row = int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))
            raise DataFormatError(path, f"row group {g}, row {row}", f"{c} is null")
        values = column.to_numpy().astype(np.int64)
        bad = np.flatnonzero(values < 0)
        if bad.size:
            where = f"row group {g}, row {int(bad[0])}"
            raise DataFormatError(path, where, f"{c} {int(values[bad[0]])} is negative")
        out[c] = values
    return out


def _sizes(filesystem: Any, paths: list[str]) -> tuple[int, int]:
    """(largest item id + 1, largest action + 1 or 1): the first pass."""
    items, actions = 0, 1
    for path in paths:
        parquet = _open(filesystem, path)
        read = [c for c in _columns(path, parquet) if c in ("item_id", "action")]
        for g in range(parquet.num_row_groups):
            cols = _group(path, parquet, g, read)
            if cols["item_id"].size:
                items = max(items, int(cols["item_id"].max()) + 1)
            if "action" in cols and cols["action"].size:
                actions = max(actions, int(cols["action"].max()) + 1)
    return items, actions


def convert_events(
    spec: str, dst: Path, row_group: int, progress: Callable[..., None]
) -> dict[str, Any]:
    """Write ``spec``'s events to ``dst`` (already checked and cleared) per user."""
    pa = _pyarrow()
    import pyarrow.parquet as pq

    filesystem, paths = list_files(spec)
    num_items, num_actions = _sizes(filesystem, paths)
    if not num_items:
        raise ValueError(f"data convert: {spec} holds no event")
    metadata = {
        "freescale.num_items": str(num_items),
        "freescale.num_actions": str(num_actions),
        "freescale.source": spec,
    }
    schema = pa.schema(
        [("user_id", pa.int64())]
        + [(c, pa.list_(pa.int64())) for c in ("items", "actions", "timestamps")]
    ).with_metadata(metadata)
    users = events = groups = read_groups = 0
    for k, path in enumerate(paths):
        parquet = _open(filesystem, path)
        read = _columns(path, parquet)
        with pq.ParquetWriter(str(dst / PART.format(k)), schema) as writer:
            pending: list[dict[str, np.ndarray]] = []  # rows not yet written (whole users)
            held = 0  # events in pending
            carry: dict[str, np.ndarray] | None = None  # the last user of the last group
            for g in range(parquet.num_row_groups):
                cols = _group(path, parquet, g, read)
                if carry is not None:
                    cols = {c: np.concatenate([carry[c], cols[c]]) for c in cols}
                    first = -carry["user_id"].size
                else:
                    first = 0
                user = cols["user_id"]
                if not user.size:
                    continue
                step = np.diff(user)
                if (step < 0).any():
                    r = int(np.argmax(step < 0)) + 1
                    raise DataFormatError(
                        path, f"row group {g}, row {r + first}",
                        f"user_id {int(user[r])} after {int(user[r - 1])}: rows must be sorted "
                        "by user_id within a file",
                    )  # fmt: skip
                starts = np.flatnonzero(step) + 1
                cut = int(starts[-1]) if starts.size else 0
                done = {c: v[:cut] for c, v in cols.items()}
                carry = {c: v[cut:] for c, v in cols.items()}
                if cut:
                    pending.append(done)
                    held += cut
                if held >= FLUSH_EVENTS:
                    users, events, groups = _flush(
                        writer, pending, row_group, (users, events, groups)
                    )
                    pending, held = [], 0
                read_groups += 1
                progress(f"data convert: file {k + 1}/{len(paths)}", done=read_groups)
            if carry is not None and carry["user_id"].size:
                pending.append(carry)
            users, events, groups = _flush(writer, pending, row_group, (users, events, groups))
    return {"users": users, "items": num_items, "actions": num_actions, "events": events,
            "files": len(paths), "row_groups": groups, "dst": str(dst)}  # fmt: skip


def _flush(writer: Any, pending: list, row_group: int, counts: tuple[int, int, int]) -> tuple:
    """Write the whole users of ``pending`` (events of each in timestamp order)."""
    pa = _pyarrow()
    users, events, groups = counts
    if not pending:
        return counts
    cols = {c: np.concatenate([p[c] for p in pending]) for c in pending[0]}
    user = cols["user_id"]
    # events of a user by timestamp (stably), users in their order of appearance
    starts = np.concatenate([[0], np.flatnonzero(np.diff(user)) + 1])
    rank = np.repeat(np.arange(starts.size), np.diff(np.concatenate([starts, [user.size]])))
    order = np.lexsort((cols["timestamp"], rank))
    lengths = np.diff(np.concatenate([starts, [user.size]]))
    actions = cols["action"][order] if "action" in cols else np.zeros(user.size, np.int64)
    table = pa.table(
        {
            "user_id": user[starts],
            "items": list_array(lengths, cols["item_id"][order], pa.int64()),
            "actions": list_array(lengths, actions, pa.int64()),
            "timestamps": list_array(lengths, cols["timestamp"][order], pa.int64()),
        },
        schema=writer.schema,
    )
    for lo in range(0, table.num_rows, row_group):
        writer.write_table(table.slice(lo, row_group))
        groups += 1
    return users + table.num_rows, events + int(user.size), groups
