"""A store's side of a dynamic table: the map, new rows, the rows a call evicted, counts.

`ShardStore` holds one `DynamicShard` for a dynamic table and passes it its
row tensors (weight and optimizer state) where it reads or writes them:

- `receive`: a learning call maps its ids (`DynamicMap.map`), the ranks
  agree that no shard overflowed (`check_capacity`), then the map commits,
  the evicted ids' rows and state are kept and the new ids' rows start from
  (table seed, id); another call only reads (-1: no row, zeros; ``behind``:
  the table as it was before a call mapped ahead of its step, the evicted
  rows read as ``-2 - k``).
- `read`: the rows of such slots; `drop`: gradient rows of ids without a row.
- `entries`: the held slots as copies, as a checkpoint takes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from freescale.embedding.dynamic.map import DynamicMap, MapResult
from freescale.embedding.dynamic.spec import initial_rows


class DynamicShard:
    """The dynamic table ``table`` of a store with ``slots`` slots on ``device``,
    its rows seeded by ``seed`` (`freescale.embedding.dynamic.spec.table_seed`)."""

    def __init__(self, table: Any, slots: int, device: torch.device, seed: int) -> None:
        assert table.dynamic is not None
        self.table, self.seed = table, seed
        self.map = DynamicMap(table.dynamic, slots, device)
        self.stats = DynamicStats(slots=slots)
        self.evicted: dict[str, Tensor] = {}  # rows and state the last call evicted
        self._readable_of: tuple[Tensor, Tensor] | None = None

    def receive(
        self, recv: Tensor, comm: Any, learns: bool, behind: bool, rows: dict[str, Tensor],
        inits: dict[str, float],
    ) -> Tensor:  # fmt: skip
        """The slots of the ids ``recv`` (see the module docstring); ``rows``:
        the store's weight and state tensors, ``inits``: the state's initial values."""
        pad = self.table.padding_idx
        if pad is None:
            return self._map(recv, comm, learns, behind, rows, inits)
        keep = recv != pad  # looked up, never given a row: reads zeros
        slots = torch.full_like(recv, -1)
        slots[keep] = self._map(recv[keep], comm, learns, behind, rows, inits)
        return slots

    def _map(self, ids: Tensor, comm: Any, learns: bool, behind: bool, rows: dict[str, Tensor],
             inits: dict[str, float]) -> Tensor:  # fmt: skip
        m = self.map
        if not learns:
            return m.find_before(ids) if behind else m.find(ids)
        result = m.map(ids)
        check_capacity(self.table, result, comm, m)
        evicted = result.new_slots[m.occupied[result.new_slots]]
        self.evicted = {n: t[evicted.to(t.device)] for n, t in rows.items()}
        m.commit(result)
        self._start_rows(result.new_slots, result.new_ids, rows, inits)
        self.stats.add(result, m.occupancy, m.capacity)
        return result.slots

    def _start_rows(self, slots: Tensor, ids: Tensor, rows: dict[str, Tensor],
                    inits: dict[str, float]) -> None:  # fmt: skip
        if not slots.numel():
            return
        weight = rows["weight"]
        values = initial_rows(
            self.seed, ids, weight.shape[1], weight.dtype, self.table.dynamic.bound
        )
        where = slots.to(weight.device)
        with torch.no_grad():
            weight[where] = values.to(weight.device)
            for name, init in inits.items():
                rows[name][where] = init

    def readable(self, slots: Tensor) -> Tensor:
        """``slots`` with those of ids without a row (< 0) at slot 0, masked
        after the read; the same tensor for the same slots, so that a host
        tier's staged rows are found by the lookup."""
        if self._readable_of is None or self._readable_of[0] is not slots:
            self._readable_of = (slots, slots.clamp(min=0))
        return self._readable_of[1]

    def read(self, slots: Tensor, gather: Callable[[Tensor], Tensor]) -> Tensor:
        """Rows of ``slots`` by ``gather`` (the store's): -1 zeros, ``-2 - k``
        the k-th row the last call evicted."""
        rows = gather(self.readable(slots))
        old = self.evicted.get("weight")
        if old is not None and old.shape[0]:  # (no host read: where, not a mask)
            back = old.to(rows.device)[(-2 - slots).clamp(0, old.shape[0] - 1)]
            rows = torch.where((slots <= -2).unsqueeze(1), back, rows)
        return torch.where((slots == -1).unsqueeze(1), rows.new_zeros(()), rows)

    def drop(self, slots: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
        """The gradient rows of ids with a row; the others counted."""
        held = slots >= 0
        self.stats.dropped += int(slots.numel() - int(held.sum()))
        return slots[held], grads[held]

    def entries(self, before: bool, rows: dict[str, Tensor]) -> dict[str, Tensor]:
        """The held slots as copies: ``slot``, ``id``, ``last_used``, ``uses``
        and each of ``rows`` per held slot, with the map's other tensors
        (``pend_*``, ``calls``). ``before``: as before the last call was mapped
        (a call mapped ahead of its step: what a synchronous run holds now)."""
        m = self.map.before_last(undo=before)
        slots = m["occupied"].nonzero().squeeze(1)
        out = {n: t[slots] for n, t in rows.items()}
        u = self.map.undo
        if before and u is not None:  # evicted slots hold their old rows
            back = torch.searchsorted(slots, u["new"][u["old_occupied"]])
            for n, t in out.items():
                t[back] = self.evicted[n].to(t.device)
        out.update({"slot": slots, "id": m["slot_ids"][slots], "last_used": m["last_used"][slots],
                    "uses": m["uses"][slots]})  # fmt: skip
        out.update({k: v for k, v in m.items() if k.startswith("pend_") or k == "calls"})
        return out


class DynamicTableFull(ValueError):
    """A call's ids on one shard need more rows than it holds (nothing evictable)."""


@dataclass
class DynamicStats:
    """A dynamic store's counts since they were last taken (`take`)."""

    inserts: int = 0
    evictions: int = 0
    not_admitted: int = 0  # distinct ids seen without getting a row, per call
    dropped: int = 0  # gradient rows of ids without a row
    held: int = 0  # slots holding an id, after the last call
    slots: int = 0

    def add(self, result: MapResult, held: int, slots: int) -> None:
        self.inserts += int(result.new_ids.numel())
        self.evictions += result.evicted
        self.not_admitted += result.not_admitted
        self.held, self.slots = held, slots

    def take(self) -> tuple[int, int, int, int, int, int]:
        """(held, slots, inserts, evictions, not admitted, dropped); the counts restart."""
        out = (self.held, self.slots, self.inserts, self.evictions, self.not_admitted, self.dropped)
        self.inserts = self.evictions = self.not_admitted = self.dropped = 0
        return out


def check_capacity(table: Any, result: MapResult, comm: Any, dmap: DynamicMap) -> None:
    """Raise `DynamicTableFull` on every rank, before any shard changes, if
    one shard's call needs more rows than it has (a collective)."""
    mine = torch.tensor([[int(result.overflow), result.needed]], dtype=torch.int64)
    every = mine if comm.world_size == 1 else comm.all_gather(mine.to(comm.device)).wait().cpu()
    full = every[:, 0].nonzero().flatten().tolist()
    if not full:
        return
    rank, needed = full[0], int(every[full[0], 1])
    spec = table.dynamic
    raise DynamicTableFull(
        f"dynamic table {table.name!r} is full on rank {rank} at step {int(dmap.calls)}: "
        f"its ids need {needed} rows (this lookup's and the one before it's), the shard "
        f"holds {dmap.capacity} (capacity {spec.capacity} over {comm.world_size} ranks); "
        f"raise embeddings.tables.{table.name}.capacity"
    )


def counts_of(shards: list[DynamicShard]) -> tuple[int, ...] | None:
    """`DynamicStats.take` of every shard, summed; None for no shard."""
    if not shards:
        return None
    taken = [d.stats.take() for d in shards]
    return tuple(sum(col) for col in zip(*taken, strict=True))


def gather_by_id(
    comm: Any, dmap: DynamicMap, weight: Tensor, state: dict[str, Tensor]
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """(ids, rows, optimizer state) of one dynamic table over every rank of
    ``comm``, by id: each rank's slots gathered (a collective per tensor)."""
    parts = {"ids": dmap.slot_ids, "held": dmap.occupied, "rows": weight, **state}
    device = comm.device
    every = {k: comm.all_gather(v.to(device).contiguous()).wait() for k, v in parts.items()}
    keep = every.pop("held")
    ids = every.pop("ids")[keep]
    order = torch.argsort(ids)
    rows = every.pop("rows")[keep][order]
    return ids[order], rows, {k: v[keep][order] for k, v in every.items()}
