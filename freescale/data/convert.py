"""``freescale data convert``: a file the in-memory readers take -> the ``parquet-stream`` layout.

``events:PATH`` (Parquet with one row per event: `freescale.data.events`,
out of core, one output file per input file, ids as given). Any other
source is read by its in-memory reader (`freescale.data.source.READERS`:
``sasrec:``, ``movielens:``, ``parquet:``, ``csv:``), so the users, their
order, the remapped item ids and ``num_items`` / ``num_actions`` are exactly
the in-memory source's: a model trained on one is evaluated on the other
with the same ids. The destination is a directory of ``files`` Parquet files
(``part-00000.parquet`` ...; users dealt in contiguous runs, in the reader's
order) with row groups of ``row_group`` rows and the columns

- ``user_id``: the user's index in the reader's order (0, 1, ...);
- ``items``, ``actions``, ``timestamps``: list columns, events in time order
  (``timestamps``: the reader's; a SASRec file's are line numbers);
- the ``uih``-level columns of ``features`` (Parquet / CSV sources);

and the file metadata ``freescale.num_items``, ``freescale.num_actions``,
``freescale.source`` (the spec read) and, with features,
``freescale.features`` (``NAME:uih:ROWS,...``, the value to give ``data.features``).

The destination is checked as ``freescale data split``'s is
(`freescale.data.parquet_files.check_output`): one that exists and is not
empty is refused unless ``force``, and ``force`` only ever replaces what a
previous run of the same command wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from freescale.data.columnar import _pyarrow, parse_features
from freescale.data.events import convert_events
from freescale.data.ids import ITEMS, LAYOUT_IDS, write_maps
from freescale.data.parquet_files import PART, PART_RE, check_output, clear_output, list_array
from freescale.data.progress import Progress
from freescale.data.readers import SequenceDataset, check_file
from freescale.data.source import READERS


def _owned(name: str) -> bool:
    return name == LAYOUT_IDS or PART_RE.fullmatch(name) is not None


def convert(
    spec: str,
    dst: str | Path,
    files: int = 1,
    row_group: int = 10_000,
    features: str | None = None,
    force: bool = False,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write ``spec``'s users to ``dst`` (module docstring); a summary of what was written."""
    kind, _, path = spec.partition(":")
    if kind not in (*READERS, "events") or not path:
        specs = " | ".join(f"{k}:PATH" for k in (*READERS, "events"))
        raise ValueError(f"data convert reads {specs}; got {spec!r}")
    if files < 1 or row_group < 1:
        raise ValueError(f"--files and --row-group must be >= 1, got {files}, {row_group}")
    if kind == "events":  # one row per event, out of core (`freescale.data.events`)
        if features:
            raise ValueError("--features: events: data carry no extra columns yet")
        out = check_output(dst, PART_RE.fullmatch, force, "data convert")
        clear_output(out, PART_RE.fullmatch)
        return convert_events(path, out, row_group, Progress(say, unit="row group"))
    wanted = parse_features(features)
    if wanted and kind not in ("parquet", "csv"):
        raise ValueError(f"--features: {kind}: files have no extra columns (parquet: and csv: do)")
    per_item = [f"{n}:{lv}" for n, lv, _ in wanted if lv != "uih"]
    if per_item:
        raise ValueError(
            f"--features {per_item[0]}: parquet-stream reads uih-level features only "
            "(a candidates-level one is a table over every item)"
        )
    check_file(path)
    out = check_output(dst, _owned, force, "data convert")
    progress = Progress(say, unit="user")
    progress(f"data convert: reading {spec}", force=True)
    dataset = READERS[kind](path, **({"features": features} if wanted else {}))
    users = len(dataset.users)
    if not users:
        raise ValueError(f"data convert: {spec} holds no user")
    if files > users:
        raise ValueError(f"data convert: --files {files} > {users} users")
    clear_output(out, _owned)
    metadata = {
        "freescale.num_items": str(dataset.num_items),
        "freescale.num_actions": str(dataset.num_actions),
        "freescale.source": spec,
    }
    if dataset.features:
        metadata["freescale.features"] = ",".join(
            f"{f.name}:uih:{f.rows}" for f in dataset.features
        )
    bounds = np.linspace(0, users, files + 1).astype(np.int64).tolist()
    events = groups = 0
    for k in range(files):
        lo, hi = bounds[k], bounds[k + 1]
        events += _write_part(out / PART.format(k), dataset, lo, hi, row_group, metadata)
        groups += -(-(hi - lo) // row_group)
        progress(f"data convert: {k + 1}/{files} files", done=hi, total=users)
    if dataset.item_ids is not None:  # the raw id of each row, for the runs on this layout
        write_maps({ITEMS: dataset.item_ids}, out, LAYOUT_IDS)
    progress(f"data convert: {files}/{files} files, {users}/{users} users: done", force=True)
    return {
        "users": users,
        "items": dataset.num_items,
        "actions": dataset.num_actions,
        "events": events,
        "files": files,
        "row_groups": groups,
        "dst": str(out),
    }


def _write_part(
    path: Path, dataset: SequenceDataset, lo: int, hi: int, row_group: int, metadata: dict
) -> int:
    """Users ``[lo, hi)`` as one Parquet file; its event count."""
    pa = _pyarrow()
    import pyarrow.parquet as pq

    histories = dataset.users[lo:hi]
    lengths = np.array([h.items.size for h in histories], dtype=np.int64)

    def column(get: Callable[[Any], np.ndarray]) -> Any:
        values = [get(h) for h in histories]
        return list_array(lengths, np.concatenate(values).astype(np.int64), pa.int64())

    table = pa.table(
        {
            "user_id": np.arange(lo, hi, dtype=np.int64),
            "items": column(lambda h: h.items),
            "actions": column(lambda h: h.actions),
            "timestamps": column(lambda h: h.timestamps),
            **{f.name: column(lambda h, n=f.name: h.features[n]) for f in dataset.features},
        }
    ).replace_schema_metadata(metadata)
    pq.write_table(table, path, row_group_size=row_group)
    return int(lengths.sum())
