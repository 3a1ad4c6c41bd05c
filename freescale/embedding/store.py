"""`ShardStore`: this rank's slice of every table of one (dtype, dim, optimizer) group.

The local weight is one ``[slots, dim]`` tensor: table t's local shard is the
slot range ``[starts[t], starts[t] + sharding_t.local_rows)``. Optimizer state
is per slot, fp32. Per-table step counters (host int64) drive the lr hook
and Adam's bias correction.

With ``placement="host"`` the weight and the optimizer state live in host
memory (pinned on a GPU) and every read and write goes through the store's
`HostTier` (`freescale.embedding.host_tier`); ``device`` stays the device
lookups return rows on and updates compute on.

A dynamic table (`freescale.embedding.dynamic`) has a store of its own and
a `DynamicShard` that maps the ids arriving here to slots (`receive`).

Its state dict holds this rank's slots as they lie, keys naming the rank
(`freescale.embedding.per_rank`).
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from freescale.embedding._ops import sum_duplicates
from freescale.embedding.config import Placement, TableConfig
from freescale.embedding.dynamic.shard import DynamicShard
from freescale.embedding.host_tier import HostTier, host_tensor
from freescale.embedding.optim import OptimizerConfig, Scalar, apply_rows, make_state
from freescale.embedding.per_rank import PerRankState
from freescale.jagged.ops import copy_to_host, host_to_device, side_stream, wait_for_copy
from freescale.kernels import gather_rows
from freescale.kernels.backend import choose_impl, triton_module
from freescale.kernels.shard import RowSharding


class ShardStore(PerRankState, nn.Module):
    """Local rows + optimizer state of the tables of one group on one rank."""

    def __init__(
        self,
        tables: Sequence[TableConfig],
        shardings: Sequence[RowSharding],
        optimizer: OptimizerConfig,
        rank: int,
        device: torch.device,
        seed: int = 0,
        placement: Placement = "device",
    ) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.placement = placement
        self.tables = list(tables)
        self.shardings = list(shardings)
        self.optimizer = optimizer
        self.rank = rank
        self.world_size = shardings[0].world_size
        self.dim, self.dtype = tables[0].dim, tables[0].dtype
        sizes = [s.local_rows for s in shardings]
        self.starts = [sum(sizes[:i]) for i in range(len(sizes))]
        self.slots = sum(sizes)
        self.tier: HostTier | None = None
        self.dynamic: DynamicShard | None = None  # a dynamic table's map and rows by id
        if tables[0].dynamic is not None:
            if len(tables) != 1:
                raise ValueError("a dynamic table has a store of its own")
            self.dynamic = DynamicShard(tables[0], self.slots, self.device, seed)
        weight = self._init_weight(seed)
        if placement == "host":
            state = _host_state(optimizer, self.slots, self.dim, self.device)
            state_bytes = sum(v[0].numel() * v.element_size() for v in state.values() if len(v))
            self.tier = HostTier(self.device, self.dim * weight.element_size() + state_bytes)
        else:
            state = make_state(optimizer, self.slots, self.dim, self.device)
        self.register_buffer("weight", weight, persistent=False)
        self.state_names = list(state)
        for name, t in state.items():
            self.register_buffer(name, t, persistent=False)
        self.register_buffer("steps", torch.zeros(len(tables), dtype=torch.int64), persistent=False)
        self._host_steps = [0] * len(tables)  # mirror of ``steps``: lr needs no device read
        # Whether the hyperparameters depend on the step count (an lr schedule, Adam).
        opt = optimizer
        self._counts_matter = opt.lr_schedule is not None or (
            opt.bias_corrections(2) != opt.bias_corrections(1)
        )
        # Steps counted before their skip flag was read: (tables, flag copy, its event).
        self._unsettled: deque[tuple[list[int], Tensor, Any]] = deque()
        self.register_buffer("frozen_slots", self._padding_slots(device), persistent=False)
        # First slot of every table but the first: a slot's table is a bucketize.
        bounds = torch.tensor(self.starts[1:], dtype=torch.int64, device=device)
        self.register_buffer("table_bounds", bounds, persistent=False)
        self._update_done: torch.cuda.Event | None = None  # the last fused update (`join_update`)

    # ---- construction --------------------------------------------------------
    def _init_weight(self, seed: int) -> Tensor:
        """Uniform(+-sqrt(1/rows)) per table, seeded by (seed, rank); depends on W.

        For world-size-independent initial values use `set_table`, as `swap` does.
        A host-tier store draws them on the host (on a GPU run: other values
        than the same table on the device; `set_table` starts are equal).
        """
        if self.placement == "host":
            weight = host_tensor((self.slots, self.dim), self.dtype, self.device)
        else:
            weight = torch.empty(self.slots, self.dim, dtype=self.dtype, device=self.device)
        if self.dynamic is not None:  # rows start when an id arrives (`receive`)
            return weight.zero_()
        gen = torch.Generator(device=weight.device).manual_seed(seed * 1_000_003 + self.rank)
        for t, start, s in zip(self.tables, self.starts, self.shardings, strict=True):
            bound = math.sqrt(1.0 / t.rows)
            weight[start : start + s.local_rows].uniform_(-bound, bound, generator=gen)
        return weight

    def _padding_slots(self, device: torch.device) -> Tensor:
        slots = []
        for t, start, s in zip(self.tables, self.starts, self.shardings, strict=True):
            if t.padding_idx is None or t.dynamic is not None:  # (dynamic: `receive`)
                continue
            owner, slot = s.locate(torch.tensor([t.padding_idx]))
            if int(owner) == self.rank:
                slots.append(start + int(slot))
        return torch.tensor(sorted(slots), dtype=torch.int64, device=device)

    # ---- training ------------------------------------------------------------
    def receive(self, recv: Tensor, comm: Any, learns: bool, behind: bool = False) -> Tensor:
        """The local slots of the ids a lookup call brought this shard: a
        static table's are what arrived; a dynamic table maps its ids
        (`freescale.embedding.dynamic.shard`: a learning call inserts and
        evicts, another only reads; ``behind``: as the table was before a
        call mapped ahead of its step)."""
        if self.dynamic is None:
            return recv
        if learns:
            self.join_update()
        inits = {n: init for n, (_, init) in self.optimizer.state_specs(self.dim).items()}
        slots = self.dynamic.receive(recv, comm, learns, behind, self._row_tensors(), inits)
        if learns and self.tier is not None:
            self.tier.drop()  # new rows written behind the staged ones
        return slots

    def _row_tensors(self) -> dict[str, Tensor]:
        return {"weight": self.weight, **self.optimizer_state()}

    def dynamic_entries(self, before: bool) -> dict[str, Tensor]:
        """`DynamicShard.entries` of this store's rows (a dynamic table's)."""
        assert self.dynamic is not None
        return self.dynamic.entries(before, self._row_tensors())

    def lookup(self, slots: Tensor) -> Tensor:
        self.join_update()
        if self.dynamic is not None:  # -1: no row (zeros); <= -2: a row the last call evicted
            return self.dynamic.read(slots, self._gather)
        return self._gather(slots)

    def _gather(self, slots: Tensor) -> Tensor:
        if self.tier is not None:
            return self.tier.gather(self.weight, slots)
        return gather_rows(self.weight, slots)

    @property
    def stages(self) -> bool:
        """Whether `stage` does anything (a host-tier store)."""
        return self.tier is not None

    def stage(self, slots: Tensor) -> None:
        """The next `lookup` will be of ``slots``: a host-tier store starts
        gathering them now (`HostTier.stage`); a device store has nothing to do."""
        if self.tier is not None:
            self.join_update()
            staged = slots if self.dynamic is None else self.dynamic.readable(slots)
            self.tier.stage(self.weight, staged)

    def section(self, name: str) -> str:
        """The timer section of ``name`` (lookup, update) for this store's tables:
        ``host_``-prefixed on the host tier, whose traffic is reported apart."""
        return name if self.tier is None else f"host_{name}"

    def join_update(self) -> None:
        """Order the current stream after the last fused update (`_apply_fused`
        runs it on a side stream). Every read of the rows or the optimizer state
        here (lookup, state dict, table views) calls this; a device-side wait,
        the host does not block."""
        if self._update_done is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).wait_event(self._update_done)

    def _apply(self, fn: Any, recurse: bool = True) -> ShardStore:
        """``.to()``, ``.cpu()``, ...: the tensors are read after the last update.
        A host-tier store's rows and state stay on the host (its placement)."""
        self.join_update()
        self._update_done = None  # an event of the old device
        if self.tier is None:
            return super()._apply(fn, recurse)
        kept = {name: getattr(self, name) for name in ("weight", *self.state_names)}
        super()._apply(fn, recurse)
        for name, t in kept.items():
            self._buffers[name] = t
        self.tier.drop()
        return self

    def __getstate__(self) -> dict[str, Any]:
        """Pickling and deep copies read the tensors after the last update; the
        CUDA event itself does not travel."""
        self.join_update()
        return {**self.__dict__, "_update_done": None}

    def apply_gradients(
        self, slots: Tensor, grads: Tensor, tables: Sequence[int], skip: Tensor | None = None
    ) -> None:
        """One optimizer step of ``tables`` with shard-major gradients of ``slots``.

        ``skip`` (a device flag, `freescale.embedding.nonfinite`): when true the
        step changes no row, no state and, once the flag is read, no step counter.
        """
        self.apply_update(slots, grads, self.advance(tables, skip), skip)

    def advance(self, tables: Sequence[int], skip: Tensor | None = None) -> tuple[int, ...]:
        """Count one step of each table in ``tables``; return every table's step.

        The returned steps select the hyperparameters (lr schedule, Adam's bias
        correction) of this step's update, also when part of it is applied later.
        A step that may be skipped is counted now and taken back when its flag
        is read: at the next step that needs exact counters (an lr schedule,
        Adam), otherwise whenever the flag's copy has arrived; neither waits
        for the GPU in practice (the flag was computed a step earlier).
        """
        self.settle(wait=self._counts_matter)
        touched = sorted(set(tables))
        for t in touched:
            self.steps[t] += 1
            self._host_steps[t] += 1
        if skip is not None and touched:
            self._unsettled.append((touched, *copy_to_host(skip)))
        return tuple(self._host_steps)

    def settle(self, wait: bool = True) -> None:
        """Take back the step counts of skipped steps whose flags can be read
        (all of them when ``wait``; otherwise only those already on the host)."""
        while self._unsettled:
            tables, flag, event = self._unsettled[0]
            if event is not None and not wait and not event.query():
                return
            wait_for_copy(event, "skipped-step counters")
            self._unsettled.popleft()
            if bool(flag):
                for t in tables:
                    self.steps[t] -= 1
                    self._host_steps[t] -= 1

    def apply_update(
        self,
        slots: Tensor,
        grads: Tensor,
        steps: Sequence[int],
        skip: Tensor | None = None,
    ) -> None:
        """Update the rows of ``slots`` with the hyperparameters of per-table ``steps``.

        A row's update depends only on its own gradient rows (summed in arrival
        order) and its own state, so the rows of one step may be updated in
        disjoint parts, at different times, with the same result. Nothing
        changes when the device flag ``skip`` is true.
        """
        self._follow_live_hyperparameters()
        if self.dynamic is not None:  # ids without a row (not admitted): dropped, counted
            slots, grads = self.dynamic.drop(slots, grads)
        per_table = self._per_table_scalars(steps)
        if self.tier is not None:
            self.tier.count_update(slots)
        if choose_impl(None, self.device) == "triton":
            self._apply_fused(slots, grads, per_table, skip)
        else:
            self._apply_reference(slots, grads, per_table, skip)
        if self.tier is not None:  # a staged next lookup re-reads what changed
            self.tier.refresh(self.weight, slots, after=self._update_done)

    def _apply_reference(
        self,
        slots: Tensor,
        grads: Tensor,
        per_table: list[tuple[float, float, float]],
        skip: Tensor | None,
    ) -> None:
        """The torch path (the CPU's, and the Triton update's reference twin).
        A host-tier store's rows are read, updated and written on the host."""
        host = self.weight.device
        if self.tier is not None and host != self.device:
            slots, grads = slots.to(host), grads.to(host)
            skip = skip.to(host) if skip is not None else None
        rows, summed = sum_duplicates(slots, grads)
        if self.frozen_slots.numel():
            keep = ~torch.isin(rows, self.frozen_slots.to(rows.device))
            rows, summed = rows[keep], summed[keep]
        lr, bc = self._step_scalars(rows, per_table)
        apply_rows(self.optimizer, self.weight, self.optimizer_state(), rows, summed, lr, bc, skip)

    def _follow_live_hyperparameters(self) -> None:
        # `FusedOptimizer` shows the config as an editable param group; the
        # group, installed as the lr hook, carries its other values here too.
        configure = getattr(self.optimizer.lr_schedule, "configure", None)
        if configure is not None:
            self.optimizer = configure(self.optimizer)

    def _apply_fused(
        self,
        slots: Tensor,
        grads: Tensor,
        per_table: list[tuple[float, float, float]],
        skip: Tensor | None,
    ) -> None:
        """The GPU path: sums and update in Triton, with no host read-back (a
        device-to-host read here would stall the host in the middle of backward).

        It runs on a side stream, forked here: the work queued after backward
        (the dense optimizer step, the skip flags, the metrics) runs beside it
        and fills the gaps between its small kernels. Same kernels on the same
        inputs in the same order, so the same numbers; readers wait for it
        (`join_update`)."""
        if len(set(per_table)) == 1:
            lr, b1, b2 = per_table[0]
            scalars: dict[str, Any] = {"lr": lr, "bc": (b1, b2)}
        else:
            by_kind = torch.tensor(list(zip(*per_table, strict=True)), dtype=torch.float32)
            cols = host_to_device(by_kind, self.device)  # rows: lr, bc1, bc2
            scalars = {"lr": cols[0], "bc": (cols[1], cols[2]), "table_bounds": self.table_bounds}
        state = list(self.optimizer_state().values())
        cuda = self.device.type == "cuda"
        side = _update_stream(self.device) if cuda else None
        if side is not None:  # (the Triton interpreter runs on CPU tensors, in order)
            side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            triton_module("update").sparse_update(
                self.weight, state, slots, grads, frozen=self.frozen_slots, skip=skip,
                **self.optimizer.kernel_spec(), **scalars,
            )  # fmt: skip
        if side is None:
            return
        self._update_done = torch.cuda.Event()
        self._update_done.record(side)
        # Made on the main stream, read on the side one: the allocator must not
        # hand their memory out again before the side stream is done with them.
        for t in (slots, grads, skip, *scalars.values(), *scalars.get("bc", ())):
            if isinstance(t, Tensor):
                t.record_stream(side)

    def optimizer_state(self) -> dict[str, Tensor]:
        self.join_update()
        return {name: getattr(self, name) for name in self.state_names}

    def _per_table_scalars(self, steps: Sequence[int]) -> list[tuple[float, float, float]]:
        """(lr, bias correction 1, bias correction 2) of every table at ``steps``."""
        steps = [max(s, 1) for s in steps]
        return [(self.optimizer.lr_at(s), *self.optimizer.bias_corrections(s)) for s in steps]

    def _step_scalars(
        self, rows: Tensor, per_table: list[tuple[float, float, float]]
    ) -> tuple[Scalar, tuple[Scalar, Scalar]]:
        """lr and bias corrections: floats when all tables agree, else per-row columns."""
        if len(set(per_table)) == 1:
            lr, b1, b2 = per_table[0]
            return lr, (b1, b2)
        table_of_row = torch.bucketize(rows, self.table_bounds.to(rows.device), right=True)
        per_table_cols = torch.tensor(per_table, dtype=torch.float64)
        cols = host_to_device(per_table_cols, rows.device)[table_of_row]
        cols = cols.to(torch.float32).unsqueeze(-1)
        return cols[:, 0], (cols[:, 1], cols[:, 2])

    # ---- full-table views (tests, swap, debugging) ---------------------------
    def local_global_ids(self, t: int) -> Tensor:
        return self.shardings[t].global_ids(self.rank, self.weight.device)

    def full_slice(self, t: int, tensor: Tensor) -> Tensor:
        """`table_slice` on the compute device (a host-tier shard is copied:
        full-table reads, not training)."""
        return self.table_slice(t, tensor).to(self.device)

    def set_step(self, t: int, step: int) -> None:
        """Set the update count of table ``t`` (checkpoint loading)."""
        if step < 0:
            raise ValueError(f"table {self.tables[t].name!r}: step must be >= 0, got {step}")
        self.settle()  # a skipped step's count taken back later would undercount
        self.steps[t] = step
        self._host_steps[t] = step

    def table_slice(self, t: int, tensor: Tensor) -> Tensor:
        """Table ``t``'s rows of ``tensor`` (a view: callers may write through it)."""
        self.join_update()
        if self.tier is not None:
            self.tier.drop()  # a write through the view would leave it stale
        start = self.starts[t]
        return tensor[start : start + self.shardings[t].local_rows]


def _host_state(
    opt: OptimizerConfig, rows: int, dim: int, device: torch.device
) -> dict[str, Tensor]:
    """`make_state` in host memory, filled in place (no device or pageable copy)."""
    return {
        name: host_tensor((rows, *shape), torch.float32, device).fill_(init)
        for name, (shape, init) in opt.state_specs(dim).items()
    }


def _update_stream(device: torch.device) -> torch.cuda.Stream:
    """The fused updates' side stream, one per device."""
    return side_stream("embedding update", device)
