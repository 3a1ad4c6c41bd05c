"""Reading a ``torch.distributed.checkpoint`` directory without running code from it.

DCP writes two kinds of files: ``.metadata`` (the index: which tensor, which
chunk, which file, at which offset) and ``__<rank>_<n>.distcp`` (each chunk a
``torch.save`` blob). Torch reads the blobs of tensors with
``weights_only=True``, but unpickles ``.metadata`` with plain `pickle`, and a
non-tensor entry without ``weights_only``: a crafted index runs whatever
it names. Here the index is unpickled by `_IndexUnpickler`, which resolves only
the handful of classes an index is made of (DCP's metadata dataclasses,
``torch.Size``, dtypes, paths), then checked to describe what this package
writes: tensors only, in plain files of the directory, without transforms.
`check_blobs` looks into each blob's pickle (its ``data.pkl``, a few bytes, not
the tensor data) for anything ``weights_only`` would refuse, so a bad blob is
named before any tensor is loaded. `SafeReader` is DCP's file reader with this
index reader; loads go through it.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

METADATA = ".metadata"
_DCP = "torch.distributed.checkpoint."
_ALLOWED = {
    (_DCP + "metadata", name)
    for name in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    )
} | {
    (_DCP + "filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by its name
    # StorageMeta.checkpoint_id: the path written to (constructing one does nothing)
    *((m, n) for m in ("pathlib", "pathlib._local") for n in ("PosixPath", "PurePosixPath")),
}  # fmt: skip


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_metadata(path: str | os.PathLike) -> Metadata:
    """The index of the DCP directory ``path``; ValueError (one line) if it is
    unreadable, holds anything but index classes, or describes anything but
    plain tensors in files of ``path``."""
    file = Path(path) / METADATA
    try:
        with open(file, "rb") as f:
            md = _IndexUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"checkpoint file {file} holds {e}, which a checkpoint may not hold"
            " (loading it could run code); refused"
        ) from None
    except Exception as e:  # truncated, not a pickle, missing
        raise ValueError(f"checkpoint file {file} cannot be read ({_first_line(e)})") from None
    problem = _odd_index(md)
    if problem:
        raise ValueError(f"checkpoint file {file} is not an index of tensors ({problem}); refused")
    return md


def _odd_index(md: Any) -> str:
    if type(md) is not Metadata:
        return f"a {type(md).__name__}"
    for key, entry in md.state_dict_metadata.items():
        if type(entry) is not TensorStorageMetadata:  # torch loads bytes entries unrestricted
            return f"{key!r} is a {type(entry).__name__}"
    for info in (md.storage_data or {}).values():
        name = info.relative_path
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            return f"a chunk in {name!r}, outside the directory"
        if info.transform_descriptors:
            return f"a chunk with transforms {info.transform_descriptors!r}"
    return ""


def data_files(md: Metadata) -> set[str]:
    """The file names (in the directory) the index points into."""
    return {info.relative_path for info in (md.storage_data or {}).values()}


def check_blobs(path: str | os.PathLike, md: Metadata) -> None:
    """ValueError (one line naming the file) if a chunk's pickle names anything
    ``torch.load(weights_only=True)`` would refuse; reads only the pickles."""
    for info in (md.storage_data or {}).values():
        file = Path(path) / info.relative_path
        try:
            with open(file, "rb") as f:
                view = _FileView(f, info.offset, info.length)
                bad = torch.serialization.get_unsafe_globals_in_checkpoint(view)
        except Exception as e:
            raise ValueError(
                f"checkpoint file {file} cannot be read at offset {info.offset} ({_first_line(e)})"
            ) from None
        if bad:
            raise ValueError(
                f"checkpoint file {file} holds {', '.join(sorted(bad))}, which a checkpoint"
                " may not hold (loading it could run code); refused"
            )


class SafeReader(FileSystemReader):
    """DCP's file reader whose index comes from `read_metadata` (no rank-local index)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError("rank-local DCP metadata is not read")
        md = read_metadata(self.path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _FileView(io.RawIOBase):
    """Bytes ``[start, start + length)`` of an open file, as a seekable file."""

    def __init__(self, f: io.BufferedReader, start: int, length: int) -> None:
        super().__init__()
        self.f, self.start, self.length, self.pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self.length - self.pos))
        self.f.seek(self.start + self.pos)
        data = self.f.read(n)
        buffer[: len(data)] = data
        self.pos += len(data)
        return len(data)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
