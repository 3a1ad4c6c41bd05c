"""Id maps: the catalogue's own ids of the rows a reader remapped them to.

The file readers remap raw item ids to ``0..N-1`` in order of first
appearance (`freescale.data.readers`). The map is kept as one array per
table, ``raw[row]`` = the raw id of that row, and travels with the data's
converted and split layouts, every checkpoint and every export as
``ids/<table>.npy`` (a plain ``.npy``, loaded without pickle), hashed in
their manifests. A reader given a map remaps through it instead, so a file
evaluated later lands on the rows the model was trained with.

**The items a source's ids come from, and raw 64-bit ids.** A `Catalogue` is
where sampled negatives are drawn from and what numbers the
per-item tables of a source (item features, content lists, popularity) by
*position*. Two kinds:

- rows (``raw`` None): the items are ``0..size-1`` and an id is its position
  (the readers' remapped ids, synthetic rows, a stream's ids below ``num_items``);
- raw (``raw`` given: the data's own int64 ids, distinct, in a fixed order):
  position ``p`` is item ``raw[p]``. A dynamic item table takes such ids as
  they are (`freescale.embedding.dynamic`), so the data keeps them.

Draws are made in positions, then turned into ids: a source on raw ids makes
the same draws as on rows, and with the readers' order (first appearance)
each of its samples is the remapped one with every row replaced by its id.

`raw_id_map` is a fixed random injective map of int64 ids into 64 bits
(``data.raw_ids=on`` gives synthetic data such ids; benchmarks hash files with it).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

IDS = "ids"  # the folder of a checkpoint or an export holding the maps
# ... and of a parquet-stream layout (`data convert`, `data split`): a name the
# layout's listing of Parquet files skips
LAYOUT_IDS = "_ids"
ITEMS = "items"
# The batch features a table's raw ids appear in (``level.name``).
FEATURES = {ITEMS: ("uih.item_ids", "candidates.item_ids", "content.content_ids")}


def write_maps(maps: dict[str, np.ndarray], directory: str | Path, folder: str = IDS) -> list[str]:
    """``directory/folder/<table>.npy`` for each map; their paths relative to ``directory``."""
    names = []
    for table, raw in sorted(maps.items()):
        (Path(directory) / folder).mkdir(parents=True, exist_ok=True)
        path = Path(directory) / folder / f"{table}.npy"
        np.save(path, np.asarray(raw, dtype=np.int64), allow_pickle=False)
        names.append(f"{folder}/{table}.npy")
    return names


def copy_maps(src: str | Path, dst: str | Path, folder: str = LAYOUT_IDS) -> list[str]:
    """The maps of the layout ``src`` (a local directory; else none) copied into ``dst``."""
    found = sorted((Path(src) / folder).glob("*.npy")) if "://" not in str(src) else []
    for path in found:
        (Path(dst) / folder).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(dst) / folder / path.name)
    return [f"{folder}/{p.name}" for p in found]


def read_maps(directory: str | Path, folder: str = IDS) -> dict[str, np.ndarray]:
    """``{table: raw ids by row}`` of ``directory/folder`` (``directory`` may be
    that folder itself); empty without one (or for a URL). One-line
    ValueError for a file that is not a 1-D integer array of distinct ids."""
    if "://" in str(directory):
        return {}
    folder_path = Path(directory)
    if folder_path.name != folder:
        folder_path = folder_path / folder
    folder = folder_path
    maps = {}
    for path in sorted(folder.glob("*.npy")):
        try:
            raw = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ValueError(f"id map {path} cannot be read ({e})") from None
        if raw.ndim != 1 or raw.dtype.kind not in "iu" or np.unique(raw).size != raw.size:
            raise ValueError(f"id map {path} is not a 1-D array of distinct integer ids")
        maps[path.stem] = raw.astype(np.int64)
    return maps


class RowsOf:
    """Raw ids -> rows through one map; an id the map lacks is a one-line ValueError."""

    def __init__(self, raw: np.ndarray, where: str) -> None:
        order = np.argsort(raw, kind="stable")
        self.sorted = torch.from_numpy(raw[order].copy())
        self.rows = torch.from_numpy(order.astype(np.int64))
        self.where = where  # named in the error: "the export's id map", ...

    def __len__(self) -> int:
        return self.sorted.numel()

    def __call__(self, raw: Tensor, name: str) -> Tensor:
        if raw.numel() == 0 or not len(self):
            if raw.numel():
                raise ValueError(f"{name}: {int(raw[0])} is not in {self.where} (it is empty)")
            return raw
        keys, rows = self.sorted.to(raw.device), self.rows.to(raw.device)
        at = torch.searchsorted(keys, raw).clamp(max=keys.numel() - 1)
        known = keys[at] == raw
        if not bool(known.all()):
            bad = int(raw[(~known).nonzero()[0, 0]])
            raise ValueError(
                f"{name}: {bad} is not in {self.where} ({len(self)} ids); an id the model "
                "was not trained on has no row"
            )
        return rows[at]


# splitmix64's finalizer (a bijection of 64-bit words), as in freescale.embedding.dynamic
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on uint64 words (wrapping multiplies): a bijection."""
    x = x ^ (x >> np.uint64(30))
    x = x * _M1
    x = x ^ (x >> np.uint64(27))
    x = x * _M2
    return x ^ (x >> np.uint64(31))


def raw_id_map(ids: np.ndarray, seed: int) -> np.ndarray:
    """``ids`` (int64) through a fixed random bijection of 64-bit words keyed by
    ``seed``: distinct ids stay distinct, and land anywhere in int64 (negative
    ids too, as 64-bit hashes stored signed do)."""
    keys = np.random.default_rng([seed, 0x64B17]).integers(0, 2**63, 2, dtype=np.int64)
    words = np.asarray(ids, dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        out = _mix(words ^ keys[0].view(np.uint64)) ^ keys[1].view(np.uint64)
    return out.view(np.int64)


class Catalogue:
    """The items of a source (module docstring): ``size`` rows, or the ``raw`` ids."""

    def __init__(self, size: int, raw: np.ndarray | None = None) -> None:
        if raw is not None:
            raw = np.asarray(raw, dtype=np.int64)
            size = raw.size
        self.size, self.raw = int(size), raw
        if raw is not None:
            self._order = np.argsort(raw, kind="stable")
            self._sorted = raw[self._order]

    @property
    def is_raw(self) -> bool:
        return self.raw is not None

    def ids(self, positions: np.ndarray) -> np.ndarray:
        """The ids of items at ``positions``."""
        positions = np.asarray(positions, dtype=np.int64)
        return positions if self.raw is None else self.raw[positions]

    def positions(self, ids: np.ndarray) -> np.ndarray:
        """The position of each id; a one-line ValueError for an id it lacks."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.raw is None or not ids.size:
            return ids
        at = np.searchsorted(self._sorted, ids).clip(max=max(self.size - 1, 0))
        if not self.size or not np.array_equal(self._sorted[at], ids):
            bad = ids[(self._sorted[at] != ids) if self.size else 0]
            raise ValueError(f"item {int(np.ravel(bad)[0])} is not in the data's items")
        return self._order[at]

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` items uniformly, with replacement (positions drawn from ``rng``)."""
        return self.ids(rng.integers(0, self.size, n))
