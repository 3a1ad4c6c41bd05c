"""`DataSchema`: the named features a data source's batches carry.

A `SampleBatch` holds features at three levels, each a dict of named
tensors behind one offsets: ``uih`` (one value per history event),
``candidates`` (one per candidate) and ``content`` (one per content item of
a candidate). The schema lists them, and for id features the number of rows
of the table they index (ids lie in ``[0, rows)``; or, for ``raw`` ids, any
int64: the data's own ids, which a dynamic table takes). It is the data's
description a model is built from (table sizes come from here, never from a
default) and what every batch is checked against on the host before use
(`freescale.pipeline.inputs`).

The standard features (what the built-in sources produce and the reference
model reads) are `standard`'s; sources add their own (a category per history
event, a candidate's seller, ...) as extra features.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from freescale.jagged.batch import CAND_IDS, CONTENT_IDS, UIH_ACTIONS, UIH_IDS, UIH_TIMESTAMPS

LEVELS = ("uih", "candidates", "content")


@dataclass(frozen=True)
class Feature:
    """One named feature at ``level``; ``rows``: ids lie in ``[0, rows)`` (None: not
    ids); ``raw``: the ids are the data's own int64 ids, any value (a dynamic
    table's, `freescale.embedding.dynamic`), and ``rows`` is how many there are,
    a size for a table that needs one, not a bound."""

    name: str
    level: str
    rows: int | None = None
    raw: bool = False

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"feature {self.name!r}: level must be one of {LEVELS}")
        if not self.name:
            raise ValueError("a feature needs a name")
        if self.rows is not None and self.rows < 1:
            raise ValueError(f"feature {self.name!r}: rows must be >= 1, got {self.rows}")
        if self.raw and self.rows is None:
            raise ValueError(f"feature {self.name!r}: raw ids need rows (how many ids)")

    @property
    def bounded(self) -> bool:
        """Whether its ids lie in ``[0, rows)`` (an id feature, not raw ids)."""
        return self.rows is not None and not self.raw

    @property
    def key(self) -> str:
        """``level.name``: unique within a schema (messages and columns use it)."""
        return f"{self.level}.{self.name}"


@dataclass(frozen=True)
class DataSchema:
    """The features of a source's batches (standard first, then extras)."""

    features: tuple[Feature, ...]
    dense_dim: int = 0

    def __post_init__(self) -> None:
        keys = [f.key for f in self.features]
        if len(set(keys)) != len(keys):
            raise ValueError(f"duplicate features in the schema: {keys}")
        if self.dense_dim < 0:
            raise ValueError("dense_dim must be >= 0")

    @staticmethod
    def standard(
        num_items: int,
        num_actions: int,
        extra: Iterable[Feature] = (),
        dense_dim: int = 0,
        raw_items: bool = False,
    ) -> DataSchema:
        """The built-in sources' features (item ids, actions and timestamps of
        the history; candidate item ids; content ids) plus ``extra``;
        ``raw_items``: the item ids are raw (`Feature`), ``num_items`` of them."""
        base = (
            Feature(UIH_IDS, "uih", num_items, raw_items),
            Feature(UIH_ACTIONS, "uih", num_actions),
            Feature(UIH_TIMESTAMPS, "uih"),
            Feature(CAND_IDS, "candidates", num_items, raw_items),
            Feature(CONTENT_IDS, "content", num_items, raw_items),
        )
        return DataSchema(base + tuple(extra), dense_dim)

    def get(self, level: str, name: str) -> Feature:
        for f in self.features:
            if f.level == level and f.name == name:
                return f
        raise KeyError(f"the data has no {level} feature {name!r}; it has {self.keys()}")

    def rows(self, level: str, name: str) -> int:
        """Rows of the table ``level.name`` indexes (ValueError if not an id feature)."""
        rows = self.get(level, name).rows
        if rows is None:
            raise ValueError(f"{level} feature {name!r} is not an id feature")
        return rows

    def keys(self) -> list[str]:
        return [f.key for f in self.features]

    @property
    def num_items(self) -> int:
        return self.rows("uih", UIH_IDS)

    @property
    def num_actions(self) -> int:
        return self.rows("uih", UIH_ACTIONS)

    def extras(self) -> tuple[Feature, ...]:
        """The features beyond `standard`'s, in order."""
        base = {f.key for f in DataSchema.standard(1, 1).features}
        return tuple(f for f in self.features if f.key not in base)
