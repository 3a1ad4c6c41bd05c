"""How a collection lays its tables out: stores (groups of tables) and row shardings.

Tables with equal (dtype, dim, optimizer, placement) share a store; a
dynamic table has one of its own (it maps its own ids to its slots).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from freescale.embedding.config import Placement, ShardingPlan, TableConfig
from freescale.kernels.shard import RowSharding


def group_tables(
    tables: Sequence[TableConfig], plan: ShardingPlan
) -> list[tuple[Any, Placement, list[TableConfig]]]:
    """(optimizer, placement, tables) of each store: equal dtype, dim, optimizer
    and placement share one."""
    groups: dict[tuple, list[TableConfig]] = {}
    for t in tables:
        # a dynamic table maps its own ids to its slots: a store of its own
        own = t.name if t.dynamic is not None else None
        key = (t.dtype, t.dim, plan.optimizer_for(t), plan.placement_for(t), own)
        groups.setdefault(key, []).append(t)
    return [(key[2], key[3], members) for key, members in groups.items()]


def row_sharding(table: TableConfig, world: int, plan: ShardingPlan) -> RowSharding:
    """A static table's row assignment; a dynamic one's slots (owners come from
    `freescale.embedding.dynamic.owner_of`, slots from its map)."""
    if table.dynamic is not None:
        return RowSharding(table.dynamic.local_capacity(world) * world, world, "block")
    return RowSharding(table.rows, world, plan.assignment, plan.block_size)


def check_names(tables: Sequence[TableConfig]) -> None:
    if not tables:
        raise ValueError("a ShardedEmbeddingCollection needs at least one table")
    names = [t.name for t in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate table names: {names}")
    features = [f for t in tables for f in t.features]
    if len(set(features)) != len(features):
        raise ValueError(f"a feature may look up only one table: {features}")


def host_tier_bytes(grouped: list[tuple[Any, Placement, list[TableConfig]]], world: int) -> int:
    """Host memory one rank's host-tier shards take (rows + optimizer state), at
    most ceil(rows / W) rows per table (the largest share of any assignment; a
    dynamic table's slots per rank)."""
    total = 0
    for opt, placement, members in grouped:
        if placement != "host":
            continue
        for t in members:
            state = sum(math.prod(shape) * 4 for shape, _ in opt.state_specs(t.dim).values())
            row = t.dim * torch.empty((), dtype=t.dtype).element_size() + state
            here = t.dynamic.local_capacity(world) if t.dynamic else -(-t.rows // world)
            total += here * row
    return total
