"""The synchronous sharded lookup ("vanilla TorchRec") as one autograd Function.

Forward, per group: ids AllToAll (batch-major -> shard-major) -> local lookup
-> embeddings AllToAll back (shard-major -> batch-major, aligned with the
input ids). Backward, per group: gradients AllToAll (batch-major ->
shard-major) -> sum duplicate rows in arrival order -> sparse optimizer update
on the owner. The update is fused into backward, so no dense optimizer ever
sees the tables. Every forward call has exactly one backward, which handles
its groups in a fixed order, so all ranks issue the same collectives.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from freescale.comm import Communicator, CompletedWork, Work
from freescale.embedding.dynamic.spec import owner_of
from freescale.embedding.nonfinite import NonFiniteGuard
from freescale.embedding.preflight import Request
from freescale.embedding.store import ShardStore
from freescale.kernels import DispatchPlan, apply_dispatch, ranged_combine, ranged_dispatch

# ``timer(section)`` returns a context manager wrapped around each phase:
# ids_a2a, lookup, emb_a2a (forward); grad_a2a, update (backward).
Timer = Callable[[str], AbstractContextManager[Any]]


def no_timer(section: str) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclass
class GroupCall:
    """Routing of one group's ids for one lookup call (kept for backward)."""

    store: ShardStore
    requests: list[Request]
    plan: DispatchPlan  # batch-major row j is sent from position plan.positions[j]
    send_slots: Tensor  # local slot on the owner, in send order
    send: list[int] = field(default_factory=list)
    recv: list[int] = field(default_factory=list)
    recv_slots: Tensor | None = None
    ids_work: Work | None = None  # ids AllToAll issued ahead (sdd), else None
    sorted_recv: tuple[Tensor, Tensor] | None = None  # (recv_slots, sorted): collision links
    comm: Communicator | None = None  # a dynamic table's capacity check runs on it
    learns: bool = True  # a dynamic table inserts and evicts for it (else only reads)
    behind: bool = False  # a read of a dynamic table as before a call mapped ahead

    def receive(self, recv: Tensor) -> None:
        """Take the ids that arrived on this shard: their local slots
        (`ShardStore.receive`: a dynamic table maps them here, once per call)."""
        self.recv_slots = self.store.receive(recv, self.comm, self.learns, self.behind)

    @property
    def send_counts(self) -> Tensor:
        """[W] ids per owner (device)."""
        return self.plan.counts

    @property
    def sizes(self) -> list[int]:
        return [q.ids.numel() for q in self.requests]

    @property
    def table_indices(self) -> list[int]:
        return [q.slot_table for q in self.requests]


def route(store: ShardStore, requests: list[Request], world_size: int) -> GroupCall:
    """Owner and local slot of every id of the group, bucketized by owner.

    One rank owns every id as its own slot: no owner tensor and no plan
    tensors, one copy of the ids (kernels at every step cost GPU idle time)."""
    owners, slots = [], []
    for q in requests:
        slot = q.ids  # one rank: every id is its own slot (`RowSharding.locate`)
        if world_size > 1 and store.dynamic is not None:  # the owner maps raw ids
            owners.append(owner_of(q.ids, world_size))
        elif world_size > 1:
            owner, slot = store.shardings[q.slot_table].locate(q.ids)
            owners.append(owner)
        start = store.starts[q.slot_table]
        slots.append(slot + start if start else slot)
    slot = slots[0] if len(slots) == 1 else torch.cat(slots)
    if world_size == 1:
        if slot is requests[0].ids:  # the caller's may change before backward reads them
            slot = slot.clone()
        return GroupCall(store, requests, DispatchPlan.identity(slot.shape[0], slot.device), slot)
    send_slots, plan = ranged_dispatch(slot, torch.cat(owners), world_size)
    return GroupCall(store, requests, plan, send_slots)


def issue_exchange(comm: Communicator, x: Tensor, send: list[int], recv: list[int]) -> Work:
    """``all_to_all_v`` issued; at one rank ``x`` itself, without the
    communicator's copy: for buffers made for the exchange and never written
    after it."""
    if comm.world_size == 1:
        return CompletedWork(x)
    return comm.all_to_all_v(x, send, recv)


def _exchange(comm: Communicator, x: Tensor, send: list[int], recv: list[int]) -> Tensor:
    return issue_exchange(comm, x, send, recv).wait()


def _forward(call: GroupCall, comm: Communicator, timer: Timer) -> Tensor:
    with timer("ids_a2a"):
        if call.ids_work is not None:  # issued ahead (sdd)
            work, call.ids_work = call.ids_work, None
            call.receive(work.wait())
        elif call.recv_slots is None:  # else received and staged ahead (`stage_ahead`)
            call.receive(_exchange(comm, call.send_slots, call.send, call.recv))
    with timer(call.store.section("lookup")):
        rows = call.store.lookup(call.recv_slots)
    with timer("emb_a2a"):
        back = _exchange(comm, rows, call.recv, call.send)
        return ranged_combine(back, call.plan)


def stage_ahead(call: GroupCall, timer: Timer) -> None:
    """Receive the ids of a call issued ahead and let its store stage the
    rows (a host-tier store gathers them now, `ShardStore.stage`)."""
    if call.ids_work is None or not call.store.stages:
        return
    with timer("ids_a2a"):
        work, call.ids_work = call.ids_work, None
        call.receive(work.wait())
    call.store.stage(call.recv_slots)


def _backward(
    call: GroupCall, comm: Communicator, grad: Tensor, timer: Timer, skip: Tensor | None
) -> None:
    assert call.recv_slots is not None
    with timer("grad_a2a"):
        grad_sorted = apply_dispatch(grad.to(call.store.dtype).contiguous(), call.plan)
        grad_shard = _exchange(comm, grad_sorted, call.send, call.recv)
    with timer(call.store.section("update")):
        call.store.apply_gradients(call.recv_slots, grad_shard, call.table_indices, skip)
    call.recv_slots = None  # a second backward through the same call is an error


class ShardedLookup(torch.autograd.Function):
    """Outputs: one ``[N_g, D_g]`` batch-major embedding tensor per group call.

    With a `NonFiniteGuard`, the ranks first agree whether any of them saw a
    non-finite value; if so, no row and no optimizer state changes.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        anchor: Tensor,
        calls: list[GroupCall],
        comm: Communicator,
        timer: Timer,
        guard: NonFiniteGuard | None = None,
    ) -> tuple[Tensor, ...]:
        ctx.calls, ctx.comm, ctx.timer, ctx.guard = calls, comm, timer, guard
        return tuple(_forward(call, comm, timer) for call in calls)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, ...]:
        with torch.no_grad():
            if any(call.recv_slots is None for call in ctx.calls):
                raise RuntimeError("backward ran twice through one sharded lookup")
            skip = None
            if ctx.guard is not None:  # the first wait for the other ranks: timed as such
                with ctx.timer("grad_a2a"):
                    skip = ctx.guard.agree(grads, ctx.calls[0].store.device)
            for call, grad in zip(ctx.calls, grads, strict=True):
                _backward(call, ctx.comm, grad, ctx.timer, skip)
        return None, None, None, None, None
