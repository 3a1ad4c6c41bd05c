"""The files of the ``parquet-stream`` layout: found and scanned to be read, named and written.

Reading: `list_files` finds a spec's Parquet files (a file, a directory
searched recursively, a local glob or a pyarrow URL), `scan_files` checks
their footers (`freescale.data.parquet_stream` describes the layout).
Writing (``freescale data convert`` and ``freescale data split``): output
files are named `PART`; a destination that exists and is not empty is
refused unless ``force`` (`check_output`), and ``force`` only ever replaces
what a previous run of the same command wrote (`clear_output`).
"""

from __future__ import annotations

import glob
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from freescale.data.columnar import _pyarrow
from freescale.data.readers import DataFormatError

OPTIONAL = ("actions", "timestamps")  # list columns besides items and the features
# a streamed sample's id: file, row in file, target number (`parquet_stream.split_sample_id`);
# the footers are checked against the first two
ID_BITS = (15, 32, 16)
PART = "part-{:05d}.parquet"  # output file k
PART_RE = re.compile(r"part-\d{5}\.parquet")


@dataclass(frozen=True)
class Files:
    """The data's files (sorted) and their row groups, from the footers only."""

    filesystem: Any
    paths: list[str]
    columns: list[str]  # the list columns read: items, the optional ones present, features
    piece_file: np.ndarray  # per row group: its file index
    piece_group: np.ndarray  # its row group number in the file
    piece_rows: np.ndarray  # its rows
    piece_first: np.ndarray  # its first row's index in the file
    metadata: dict[str, str]  # the first file's ``freescale.*`` keys


def list_files(spec: str) -> tuple[Any, list[str]]:
    pa = _pyarrow()
    import pyarrow.fs as pafs

    if "://" in spec:
        try:
            filesystem, root = pafs.FileSystem.from_uri(spec)
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DataFormatError(spec, None, str(e).splitlines()[0]) from None
    else:
        filesystem, root = pafs.LocalFileSystem(), str(Path(spec).absolute())
        if any(c in spec for c in "*?["):
            paths = sorted(p for p in glob.glob(root, recursive=True) if Path(p).is_file())
            if not paths:
                raise DataFormatError(spec, None, "the pattern matches no file")
            return filesystem, paths
    info = filesystem.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise DataFormatError(spec, None, "no such file or directory")
    if info.type == pafs.FileType.File:
        return filesystem, [root]
    import pyarrow.dataset as ds

    paths = sorted(ds.dataset(root, filesystem=filesystem, format="parquet").files)
    if not paths:
        raise DataFormatError(spec, None, "a directory with no Parquet file")
    return filesystem, paths


def scan_files(spec: str, extra: list[str]) -> Files:
    """Every file's footer: its schema checked (``items`` and ``extra`` present,
    every list column a list of integers, the same optional columns in every
    file), its row groups listed. One-line `DataFormatError` naming the file."""
    pa = _pyarrow()
    import pyarrow.parquet as pq

    filesystem, paths = list_files(spec)
    if len(paths) >= 2 ** ID_BITS[0]:
        raise DataFormatError(spec, None, f"{len(paths)} files: at most {2 ** ID_BITS[0] - 1}")
    columns: list[str] | None = None
    pieces: list[tuple[int, int, int, int]] = []
    metadata: dict[str, str] = {}
    for k, path in enumerate(paths):
        try:
            with filesystem.open_input_file(path) as f:
                meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
        except (pa.ArrowException, OSError) as e:
            raise DataFormatError(path, None, str(e).splitlines()[0]) from None
        names = schema.names
        if "items" not in names and "item_id" in names:  # the one-row-per-event layout
            raise DataFormatError(
                path, None, "one row per event (item_id): write one row per user with "
                "`freescale data convert events:PATH DST`, then stream DST",
            )  # fmt: skip
        for c in ("items", *extra):
            if c not in names:
                raise DataFormatError(path, None, f"no {c!r} column (columns: {names})")
        mine = ["items", *(c for c in OPTIONAL if c in names), *extra]
        if columns is None:
            columns = mine
            metadata = {
                key.decode(): value.decode()
                for key, value in (schema.metadata or {}).items()
                if key.startswith(b"freescale.")
            }
        elif mine != columns:
            raise DataFormatError(path, None, f"columns {mine} differ from {columns} of {paths[0]}")
        for c in mine:
            t = schema.field(c).type
            if not (
                (pa.types.is_list(t) or pa.types.is_large_list(t))
                and pa.types.is_integer(t.value_type)
            ):
                raise DataFormatError(path, None, f"column {c!r} is {t}, not a list of integers")
        if meta.num_rows >= 2 ** ID_BITS[1]:
            raise DataFormatError(path, None, f"{meta.num_rows} rows: at most 2**32 - 1 per file")
        first = 0
        for g in range(meta.num_row_groups):
            rows = meta.row_group(g).num_rows
            if rows:
                pieces.append((k, g, rows, first))
            first += rows
    table = np.array(pieces, dtype=np.int64).reshape(-1, 4)
    return Files(filesystem, paths, columns or [], *table.T.copy(), metadata)


def metadata_int(files: Files, key: str, given: int | None) -> int | None:
    text = files.metadata.get(f"freescale.{key}")
    if text is None:
        return given
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise DataFormatError(files.paths[0], None, f"metadata freescale.{key}={text!r}: not >= 1")
    return int(text)


def check_output(dst: str | Path, owned: Callable[[str], bool], force: bool, what: str) -> Path:
    """``dst`` as a Path if ``what`` may write there: absent, an empty directory,
    or (``force``) a directory holding only names ``owned`` (an earlier output)."""
    dst = Path(dst)
    if "://" in str(dst):
        raise ValueError(f"{what}: DST {dst} must be a local directory")
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"{what}: DST {dst} exists and is not a directory")
    entries = sorted(p.name for p in dst.iterdir()) if dst.exists() else []
    if entries and not force:
        raise ValueError(
            f"{what}: DST {dst} is not empty ({len(entries)} entries): choose a new or empty "
            "directory, or --force to replace an earlier output of this command"
        )
    foreign = [name for name in entries if not owned(name)]
    if foreign:
        raise ValueError(
            f"{what}: --force replaces only an earlier output of this command, but DST {dst} "
            f"also holds {foreign[0]!r}: remove it yourself"
        )
    return dst


def clear_output(dst: Path, owned: Callable[[str], bool]) -> None:
    """Remove the ``owned`` entries of ``dst`` (checked by `check_output`) and create it."""
    if dst.exists():
        for entry in dst.iterdir():
            if owned(entry.name):
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    dst.mkdir(parents=True, exist_ok=True)


def list_array(lengths: np.ndarray, values: np.ndarray, value_type: Any = None) -> Any:
    """A list array of ``values`` cut by ``lengths`` (large offsets when needed)."""
    pa = _pyarrow()
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    flat = pa.array(values, type=value_type)
    if offsets[-1] < 2**31:
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), flat)
    return pa.LargeListArray.from_arrays(pa.array(offsets), flat)
