"""Id maps: the catalogue's own ids of the rows a reader remapped them to.

The file readers remap raw item ids to ``0..N-1`` in order of first
appearance (`freescale.data.readers`). The map is kept as one array per
table, ``raw[row]`` = the raw id of that row, and travels with the data's
converted and split layouts, every checkpoint and every export as
``ids/<table>.npy`` (a plain ``.npy``, loaded without pickle), hashed in
their manifests. A reader given a map remaps through it instead, so a file
evaluated later lands on the rows the model was trained with.
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
