"""Table and sharding-plan configs.

A `TableConfig` describes one logical table. A `ShardingPlan` says how rows
are assigned to ranks and which optimizer each table uses. Tables with equal
(dtype, dim, optimizer) are stored together in one sharded store per rank.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Literal

import torch

from freescale.embedding.dynamic.spec import DynamicSpec
from freescale.embedding.optim import SGD, OptimizerConfig

Assignment = Literal["hashed", "block"]
# Where a table's shard (rows and optimizer state) lives: GPU memory, or the
# host tier (`freescale.embedding.host_tier`), read and written over PCIe.
Placement = Literal["device", "host"]
PLACEMENTS = ("device", "host")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class TableConfig:
    """One logical embedding table of ``rows`` x ``dim``.

    ``feature_names`` are the input keys that look this table up (default:
    the table name). ``optimizer`` None means the plan's default.
    ``padding_idx`` (as in ``nn.Embedding``) is looked up but never updated.
    ``placement``: ``"device"`` (default) or ``"host"`` (the host tier).
    ``dynamic``: a `DynamicSpec` makes it a dynamic table
    (`freescale.embedding.dynamic`): any int64 id, at most ``capacity`` rows;
    ``rows`` is then not a bound on the ids.
    """

    name: str
    rows: int
    dim: int
    dtype: torch.dtype = torch.float32
    optimizer: OptimizerConfig | None = None
    feature_names: tuple[str, ...] = ()
    padding_idx: int | None = None
    placement: Placement = "device"
    dynamic: DynamicSpec | None = None

    def __post_init__(self) -> None:
        check_placement(f"table {self.name!r}", self.placement)
        if not self.name:
            raise ValueError("table name must be non-empty")
        if self.rows < 1 or self.dim < 1:
            raise ValueError(f"table {self.name!r}: rows and dim must be >= 1")
        if self.dtype not in _DTYPES:
            raise ValueError(f"table {self.name!r}: dtype must be one of {_DTYPES}")
        if self.padding_idx is not None and not 0 <= self.padding_idx < self.rows:
            raise ValueError(f"table {self.name!r}: padding_idx outside [0, {self.rows})")
        if len(set(self.features)) != len(self.features):
            raise ValueError(f"table {self.name!r}: duplicate feature names")

    @property
    def features(self) -> tuple[str, ...]:
        return self.feature_names or (self.name,)


@dataclass
class ShardingPlan:
    """How to shard tables row-wise, and with which sparse optimizer.

    - ``assignment="hashed"`` (default): rows are cut into blocks of
      ``block_size``; each stripe of ``world_size`` consecutive blocks is
      dealt to all ranks, rotated by a hash of the stripe. Consecutive hot
      ids land on different ranks, strided ones on hashed ranks, and every
      rank holds the same number of rows.
    - ``assignment="block"``: rank r owns the contiguous range
      ``[r * ceil(rows / W), (r + 1) * ceil(rows / W))`` (TorchRec's row-wise).
    - ``optimizer`` is the default; ``table_optimizers`` overrides it per
      table name (for `swap`: per module path).
    - ``table_placements`` overrides each named table's ``placement``
      (``"device"`` or ``"host"``; for `swap`: per module path).
    - ``table_dynamics`` makes each named table dynamic (a `DynamicSpec`;
      for `swap`: per module path).
    - ``modules`` (for `swap`): glob patterns of module paths to shard;
      empty means every ``nn.Embedding`` / ``EmbeddingCollection``.
    """

    optimizer: OptimizerConfig = field(default_factory=SGD)
    assignment: Assignment = "hashed"
    block_size: int = 1
    table_optimizers: dict[str, OptimizerConfig] = field(default_factory=dict)
    modules: tuple[str, ...] = ()
    table_placements: dict[str, Placement] = field(default_factory=dict)
    table_dynamics: dict[str, DynamicSpec] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, placement in self.table_placements.items():
            check_placement(f"table {name!r}", placement)
        if self.assignment not in ("hashed", "block"):
            raise ValueError(f"assignment must be 'hashed' or 'block', got {self.assignment!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def optimizer_for(self, table: TableConfig) -> OptimizerConfig:
        if table.optimizer is not None:
            return table.optimizer
        return self.table_optimizers.get(table.name, self.optimizer)

    def placement_for(self, table: TableConfig) -> Placement:
        return self.table_placements.get(table.name, table.placement)

    def dynamic_for(self, table: TableConfig) -> DynamicSpec | None:
        return self.table_dynamics.get(table.name, table.dynamic)

    def selects(self, module_path: str) -> bool:
        return not self.modules or any(fnmatch.fnmatchcase(module_path, p) for p in self.modules)


def check_placement(what: str, placement: str) -> None:
    if placement not in PLACEMENTS:
        raise ValueError(f"{what}: placement must be one of {PLACEMENTS}, got {placement!r}")
