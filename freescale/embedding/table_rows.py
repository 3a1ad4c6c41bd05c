"""The host check of lookup ids against the rows of the table each feature hits.

Tables of one store lie end to end in its slots (`freescale.embedding.store`):
once the device check is skipped (``inputs_checked``), an id past its own
table's rows is a row of the next table, read and updated silently. A caller
that vouches for its ids checks them here, on host copies it already holds,
against the tables as built (not against what the data declares: a model may
size a table below the data's ids).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from freescale.embedding.config import TableConfig
from freescale.jagged import JaggedTensor

# What to change when a model's table is smaller than the ids it is given.
TOO_SMALL = (
    "the model's table is smaller than the ids its embedding_inputs gives it "
    "(size tables from the schema the factory gets, e.g. schema.num_items)"
)


@dataclass(frozen=True)
class TableRows:
    """``(feature, table, rows)`` for every feature a collection looks up, by feature."""

    features: tuple[tuple[str, str, int], ...]

    @staticmethod
    def of(tables: Iterable[TableConfig]) -> TableRows:
        # a dynamic table takes any int64 id (`freescale.embedding.dynamic`)
        rows = [(f, t.name, t.rows) for t in tables if t.dynamic is None for f in t.features]
        return TableRows(tuple(sorted(rows)))

    def first_beyond(self, features: Mapping[str, Any]) -> tuple[int, int] | None:
        """``(index into features, id)`` of the first id outside its table's rows
        (features in this order), or None. Host tensors or `JaggedTensor`s; keys
        no table declares and non-integer ids are left to the lookup, which
        refuses them itself."""
        for index, (feature, _, rows) in enumerate(self.features):
            ids = features.get(feature)
            if isinstance(ids, JaggedTensor):
                ids = ids.values
            if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or not ids.numel():
                continue
            values = ids.reshape(-1).numpy()  # numpy's min/max: one fast pass, no thread pool
            if values.min() >= 0 and values.max() < rows:
                continue
            return index, int(values[np.flatnonzero((values < 0) | (values >= rows))[0]])
        return None

    def describe(self, index: int, value: int) -> str:
        feature, table, rows = self.features[index]
        where = f"table {table!r} (feature {feature!r})"
        return f"{where} looked up id {value}, outside its rows [0, {rows})"
