"""The items a source's ids come from, and raw 64-bit ids.

A `Catalogue` is where sampled negatives are drawn from and what numbers the
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

import numpy as np

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
