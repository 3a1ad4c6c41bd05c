"""The `DataSource` protocol and `open_source`, which names a source by string."""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import partial
from typing import Any, Protocol

from freescale.data.columnar import read_columns
from freescale.data.ids import ITEMS, read_maps
from freescale.data.parquet_stream import OPTIONS as STREAM_OPTIONS
from freescale.data.readers import read_movielens, read_sasrec
from freescale.data.sequences import SequenceSampling, SequenceSource
from freescale.data.split_source import open_stream
from freescale.data.synthetic import SyntheticConfig, SyntheticSource
from freescale.jagged.batch import SampleBatch
from freescale.jagged.schema import DataSchema

READERS = {
    "sasrec": read_sasrec,
    "movielens": read_movielens,
    "parquet": partial(read_columns, fmt="parquet"),
    "csv": partial(read_columns, fmt="csv"),
}
# read piece by piece, never whole; a split directory (`freescale data split`) evaluates too
STREAMS = {"parquet-stream": open_stream}
FILE_SPECS = ", ".join(f"'{k}:PATH'" for k in (*READERS, *STREAMS))
BUILTIN_KINDS = ("synthetic", *READERS, *STREAMS)
# The ``data.KEY=VALUE`` options each built-in source takes (docs/train-on-your-data.md).
OPTIONS: dict[str, tuple[str, ...]] = {
    "parquet": ("features",),
    "csv": ("features",),
    "parquet-stream": STREAM_OPTIONS,
}


class DataSource(Protocol):
    """Where batches come from. Rank ``r`` of ``W`` asks for its own slice of
    global step ``s``; sources are deterministic so no rank needs another's data.

    Optional: ``starting_at(step, position) -> DataSource``, the same source
    with global step ``step`` starting at sample ``position`` of its stream
    (`freescale.data.stream`). A run resumed at another world size uses it
    to continue at the sample it stopped at; a source without it is asked
    for step ``n`` of the new world (`freescale.state.position`). A
    source that reads one stream per rank has ``with_segments(segments)``
    instead: the run's world sizes by step (`freescale.data.stream_resume`).

    Optional: ``check_rows(rank, world_size)``, this rank's share of a check of
    all the data before step 0 (`freescale.pipeline.inputs.check_all_rows`):
    an iterator with as many items on every rank, each None or ``(key, line)``
    of this rank's first problem; every rank raises the line of the smallest
    key (``parquet-stream``: `freescale.data.stream_check`)."""

    num_items: int
    num_actions: int
    # optional ``schema: DataSchema``: the batches' features (`schema_of`)

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> SampleBatch: ...

    def num_steps(self, world_size: int, batch_size: int) -> int | None: ...


def open_source(
    spec: str,
    synthetic: SyntheticConfig | None = None,
    sampling: SequenceSampling | None = None,
    options: Mapping[str, Any] | None = None,
    ids: str = "",
    raw_ids: bool = False,
) -> DataSource:
    """``synthetic`` | ``sasrec:PATH`` | ``movielens:PATH`` (ratings.dat or .csv) |
    ``parquet:PATH`` | ``csv:PATH`` (one row per user with list columns; needs pyarrow) |
    ``parquet-stream:PATH`` (the same layout, streamed: `freescale.data.parquet_stream`;
    a split directory: `freescale.data.split_source`).

    ``options``: the source's ``data.KEY=VALUE`` options (`OPTIONS`; Parquet
    and CSV take ``features``, `freescale.data.columnar`); any other is an error.
    ``ids``: a folder of id maps (`freescale.data.ids`) the file readers remap
    item ids through instead of by first appearance. ``raw_ids``: file data
    keeps its own item ids (any int64; negatives drawn from the ids it has),
    synthetic data's come from the config (`freescale.data.ids`)."""
    kind, _, path = spec.partition(":")
    if not ((kind == "synthetic" and not path) or (kind in (*READERS, *STREAMS) and path)):
        raise ValueError(f"unknown data source {spec!r}: use 'synthetic' or one of {FILE_SPECS}")
    options = dict(options or {})
    known = OPTIONS.get(kind, ())
    unknown = sorted(set(options) - set(known))
    if unknown:
        takes = ", ".join(f"data.{k}" for k in known) if known else "no data.* options"
        raise ValueError(f"data={spec!r} takes {takes}; got data.{unknown[0]}")
    if ids and kind not in READERS:
        raise ValueError(
            f"data.ids remaps the ids of {', '.join(READERS)} files; data={spec!r} takes its "
            "ids as given"
        )
    if ids and raw_ids:
        raise ValueError("data.ids remaps item ids to rows, raw ids are kept: not both")
    if kind == "synthetic":
        return SyntheticSource(synthetic)
    if kind in STREAMS:
        num_items = (synthetic or SyntheticConfig()).num_items
        return STREAMS[kind](path, sampling, num_items=num_items, raw=raw_ids, **options)
    given = read_maps(ids).get(ITEMS) if ids else None
    if ids and given is None:
        raise ValueError(f"data.ids={ids!r} holds no {ITEMS} map (ids/{ITEMS}.npy)")
    return SequenceSource(READERS[kind](path, **options, ids=given, raw=raw_ids), sampling)


def absolute_source(spec: str) -> str:
    """``spec`` with a local file path made absolute (a run's records then
    name the data wherever they are read); other specs as they are."""
    kind, _, path = spec.partition(":")
    if kind not in (*READERS, *STREAMS) or not path or "://" in path:
        return spec
    return f"{kind}:{os.path.abspath(os.path.expanduser(path))}"


def id_maps(source: Any) -> dict[str, Any]:
    """``{table: raw ids by row}`` a source remapped its ids with (empty: none)."""
    maps = getattr(source, "id_maps", None)
    return dict(maps) if maps else {}


def schema_of(source: DataSource) -> DataSchema:
    """``source.schema`` when it declares one, else the standard features sized
    by its ``num_items`` / ``num_actions``."""
    schema = getattr(source, "schema", None)
    if schema is None:
        return DataSchema.standard(source.num_items, source.num_actions)
    if not isinstance(schema, DataSchema):
        raise ValueError(f"{type(source).__name__}.schema must be a DataSchema")
    return schema
