"""A checkpoint's files: what they may hold, their digests, and the checks before use.

Checkpoints are copied between machines, shared and downloaded, so loading
one must not run code and must not use a damaged file. Two rules:

- Plain content. ``trainer.pt`` and ``rank<r>.pt`` hold only tensors, numbers,
  strings, lists, tuples and dicts: they load with
  ``torch.load(weights_only=True)``, which refuses anything else (`safe_load`
  names the file and the refused type). `write_plain` checks the same rule
  at save, so a state that grows an ndarray fails when written, not when
  loaded. The DCP files (tables, best rows) are read by
  `freescale.embedding.state.dcp_safe`.
- Digests. The manifest, written last, records ``[bytes, sha256]`` of every
  other file (`digest`); before anything is used every file's size is
  compared (missing, truncated), then its SHA-256 (altered). The manifest
  itself is checked only for form: trusting a checkpoint means trusting its
  manifest (``docs/security.md``: compare its SHA-256 with one from the source).

`read_checked` runs every check of a checkpoint and returns what the trainer
needs from it; a problem is one ValueError line naming the file.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
import pickle
import re
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from freescale.embedding.state.dcp_safe import check_blobs, data_files, read_metadata
from freescale.state.rng import check_rng_state

# 1 (no "format" key): pickled RNG states and balancer arrays, no digests;
# 2: tables as each rank's slots (same world size only), no samples_seen
FORMAT = 3
MANIFEST = "manifest.json"
TABLES = "tables"
BEST = "best"  # the best evaluation's rows (``evaluation.keep_best``), when there is one
_CHUNK = 16 << 20  # hashlib releases the GIL on large updates


def required(world: int) -> list[str]:
    """Files (relative paths) every checkpoint of ``world`` ranks has."""
    return ["trainer.pt", *(f"rank{r}.pt" for r in range(world)), f"{TABLES}/.metadata"]


def list_files(directory: Path) -> dict[str, int]:
    """Relative path -> size of every file under ``directory`` but the manifest."""
    out = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory).as_posix()
        if p.is_file() and rel != MANIFEST:
            out[rel] = p.stat().st_size
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def share(sizes: dict[str, int], world: int) -> list[list[str]]:
    """Files split over ``world`` ranks by bytes (largest first to the least
    loaded): the same split on every rank, each rank's share about equal."""
    load, parts = [0] * world, [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        r = load.index(min(load))
        parts[r].append(name)
        load[r] += sizes[name]
    return parts


def check_manifest(manifest: Any, where: Path) -> None:
    """ValueError unless ``manifest`` has this format's fields and types."""
    if not isinstance(manifest, dict):
        raise ValueError(f"checkpoint file {where} is not a manifest")
    if "format" not in manifest:
        raise ValueError(
            f"checkpoint {where.parent} is in an older format (no checksums, pickled"
            " state) that is not loaded any more; write a new one with this version"
        )
    if manifest["format"] != FORMAT:
        raise ValueError(
            f"checkpoint {where.parent} has format {manifest['format']!r}; this version"
            f" reads format {FORMAT}"
        )
    files = manifest.get("files")
    step, seen, world = (manifest.get(k) for k in ("step", "samples_seen", "world_size"))
    good = (
        isinstance(step, int)
        and isinstance(seen, int)
        and isinstance(world, int)
        and min(step, seen) >= 0
        and world >= 1
        and _segments_ok(manifest.get("segments", [[0, world]]), step, world)
        and isinstance(manifest.get("config"), dict)
        and isinstance(manifest.get("data", {}), dict)
        and isinstance(files, dict)
        and all(_entry_ok(k, v) for k, v in files.items())
    )
    if not good:
        raise ValueError(
            f"checkpoint file {where} is malformed (step, world_size, samples_seen, segments, "
            "config, files)"
        )


def _segments_ok(segments: Any, step: int, world: int) -> bool:
    """[[0, W0], [n1, W1], ...]: steps rising from 0 to at most ``step``, the
    last world size the checkpoint's (`freescale.state.position`)."""
    if not (isinstance(segments, list) and segments):
        return False
    if not all(isinstance(s, list) and len(s) == 2 and all(type(x) is int for x in s)
               for s in segments):  # fmt: skip
        return False
    steps = [n for n, _ in segments]
    return (
        steps[0] == 0
        and all(a < b for a, b in itertools.pairwise(steps))
        and steps[-1] <= step
        and min(w for _, w in segments) >= 1
        and segments[-1][1] == world
    )


def _entry_ok(name: Any, entry: Any) -> bool:
    safe = isinstance(name, str) and ".." not in name.split("/") and not name.startswith("/")
    return (
        safe
        and isinstance(entry, list)
        and len(entry) == 2
        and isinstance(entry[0], int)
        and isinstance(entry[1], str)
        and re.fullmatch(r"[0-9a-f]{64}", entry[1]) is not None
    )


def check_sizes(directory: Path, files: dict[str, list]) -> None:
    """Every recorded file exists with its recorded size (cheap: one stat each)."""
    for name, (size, _) in sorted(files.items()):
        path = directory / name
        if not path.is_file():
            raise ValueError(f"checkpoint file {path} is missing")
        actual = path.stat().st_size
        if actual != size:
            raise ValueError(
                f"checkpoint file {path} is {actual} bytes, the manifest says {size}"
                " (truncated or altered)"
            )


def check_digests(directory: Path, files: dict[str, list], names: Iterable[str]) -> None:
    """The SHA-256 of each of ``names`` is the manifest's. Files are hashed by a
    few threads at once (hashlib and reads release the GIL): the launcher's
    check of W ranks' table files takes about the time of one."""
    names = list(names)

    def digest(name: str) -> str | OSError:
        try:
            return sha256_file(directory / name)
        except OSError as e:
            return e

    workers = max(1, min(len(names), os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(workers) as pool:
        digests = list(pool.map(digest, names))
    for name, got in zip(names, digests, strict=True):  # the first problem in order
        if isinstance(got, OSError):
            raise ValueError(f"checkpoint file {directory / name} cannot be read ({got})")
        if got != files[name][1]:
            raise ValueError(
                f"checkpoint file {directory / name} was altered or damaged: its SHA-256"
                " differs from the manifest's"
            )


def safe_load(path: Path) -> Any:
    """``torch.load(weights_only=True)``; a refused type or a broken file is one line."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"checkpoint file {path} holds {_refused(e, path)}, which a checkpoint may not"
            " hold (loading it could run code); refused"
        ) from None
    except Exception as e:  # truncated, not a torch file, ...
        detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"checkpoint file {path} cannot be read ({detail})") from None


def _refused(e: Exception, path: Path) -> str:
    """The type torch refused, from its message or the file's pickle."""
    found = re.search(r"GLOBAL ([\w.]+)", str(e))
    if found:
        return found.group(1)
    try:
        bad = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:
        bad = []
    return ", ".join(sorted(bad)) or "something weights_only loading refuses"


def write_plain(obj: Any, path: Path) -> None:
    """``torch.save`` ``obj`` durably; TypeError if it would not load with
    ``weights_only=True`` (a bug in a ``state_dict``, caught at save)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    bad = torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(buf.getvalue()))
    if bad:
        raise TypeError(f"{path.name} would hold {', '.join(sorted(bad))}: state must be plain")
    with open(path, "wb") as f:
        f.write(buf.getbuffer())
        f.flush()
        os.fsync(f.fileno())


def read_checked(
    directory: Path, manifest: dict[str, Any], ranks: Iterable[int], hashed: Iterable[str]
) -> tuple[Any, dict[int, Any]]:
    """Check ``directory`` and return (trainer state, {rank: RNG state} of ``ranks``).

    Sizes of all files, SHA-256 of ``hashed`` (all of them, or this rank's
    `share`), the index and chunk pickles of the tables (and of the best
    rows, if any), then the plain loads.
    """
    files = manifest["files"]
    world = manifest["world_size"]
    for name in required(world):
        if name not in files:
            raise ValueError(f"checkpoint {directory}: its manifest lists no {name}")
    check_sizes(directory, files)
    check_digests(directory, files, hashed)
    _check_tables(directory, TABLES, files)
    if f"{BEST}/.metadata" in files:
        _check_tables(directory, BEST, files)
    trainer = safe_load(directory / "trainer.pt")
    if not isinstance(trainer, dict):
        raise ValueError(f"checkpoint file {directory / 'trainer.pt'} holds no state dict")
    best = trainer.get("best")
    if isinstance(best, dict) and "value" in best and f"{BEST}/.metadata" not in files:
        raise ValueError(f"checkpoint {directory}: its manifest lists no {BEST}/.metadata")
    rngs = {}
    for r in ranks:
        path = directory / f"rank{r}.pt"
        held = safe_load(path)
        state = held.get("rng") if isinstance(held, dict) else None
        check_rng_state(state, str(path))
        rngs[r] = state
    return trainer, rngs


def _check_tables(directory: Path, tables: str, files: dict[str, list]) -> None:
    """The DCP directory ``tables``: every data file listed, index and chunks plain."""
    index = read_metadata(directory / tables)
    for name in sorted(data_files(index)):
        if f"{tables}/{name}" not in files:
            raise ValueError(f"checkpoint {directory}: its manifest lists no {tables}/{name}")
    check_blobs(directory / tables, index)
