"""Dynamic tables: any int64 id gets a row on the fly, in bounded memory.

- `spec`: `DynamicSpec` (capacity, eviction, admission), the owner of an id,
  a new row's values;
- `map`: `DynamicMap`, one shard's id -> slot map;
- `shard`: `DynamicShard`, a store's side of it (new rows, evicted rows, counts).

Checkpoints keep a dynamic table by id (`freescale.embedding.state.dynamic_entries`);
an export serves it by id (`freescale.serving.dynamic`).
"""

from freescale.embedding.dynamic.map import DynamicMap
from freescale.embedding.dynamic.shard import DynamicShard, DynamicTableFull
from freescale.embedding.dynamic.spec import (
    DynamicSpec,
    initial_rows,
    mix64,
    owner_of,
    table_seed,
)

__all__ = [
    "DynamicMap",
    "DynamicShard",
    "DynamicSpec",
    "DynamicTableFull",
    "initial_rows",
    "mix64",
    "owner_of",
    "table_seed",
]
