"""Prioritized embedding updates (paper Algorithm 2): only collision rows wait.

Let I^i be the rows of a shard read by step i. C^i = I^i ∩ I^(i+1) (collision),
X^i = I^i \\ I^(i+1) (exclusive now), N^(i+1) = I^(i+1) \\ I^i (exclusive next).
One training step i, with ``prefetch`` called for step i+1 before step i's
backward (usually before its forward), runs:

``prefetch(features of i+1)``, off the critical path:
  1. apply the stash: the update of X^(i-1) (its gradients were exchanged
     asynchronously during step i-1's backward);
  2. ids exchange of step i+1; on each owner compute C^i, X^i, N^(i+1) in
     shard-major form (`freescale.embedding.collision_link`) and tell each
     requester which of its step-i and step-(i+1) positions are collision rows;
  3. look N^(i+1) up and send it to its requesters.
``forward(features of i)``: wait for the prefetched N^i rows and for the C^(i-1)
  rows sent at the end of step i-1's backward; merge them in batch order.
``backward``: split the gradients by the collision marks; exchange and apply
  the collision part now, look the updated C^i rows up and send them to their
  step-(i+1) requesters (the only blocking communication left); issue the
  exchange of the exclusive part and stash it, to be applied in step 1 above.

Invariant: every value read for step i+1 equals what synchronous training
reads. N^(i+1) rows are not written by step i (not in I^i) and X^(i-1) is
applied before they are read; C^i rows are read after step i's update. Each
row's update depends only on its own gradient rows, summed in arrival order
(source rank, then the sender's order), and its own state; the collision marks
are per row, so both parts keep that order, and a deferred part uses the
hyperparameters (lr schedule, bias correction) of its own step. The result is
bit-identical to the synchronous path (tests/embedding/test_prioritized.py).

Without a prefetched next step (last step, a lookup used without prefetching)
C^i is empty and backward applies the whole update at once. ``flush`` applies
the stash (before evaluation, checkpointing, the end of training); X^i and
N^(i+1) are disjoint, so flushing never invalidates prefetched rows. At most
one step is prefetched ahead, one lookup call per step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from freescale.comm import Communicator, Work
from freescale.embedding import collision_link, input_dist
from freescale.embedding.collision_link import Link, fill_marked, split_marked
from freescale.embedding.lookup import GroupCall, Timer, no_timer
from freescale.embedding.nonfinite import NonFiniteGuard
from freescale.embedding.store import ShardStore
from freescale.kernels import apply_dispatch, ranged_combine


@dataclass
class StepState:
    """One lookup call of the schedule, from its prefetch to its backward."""

    prepared: input_dist.PreparedLookup
    exclusive: dict[int, Work] = field(default_factory=dict)  # group -> N rows (send order)
    collided: dict[int, Work] = field(default_factory=dict)  # group -> updated C rows
    prev: dict[int, Link] = field(default_factory=dict)  # group -> split with the step before
    next: dict[int, Link] = field(default_factory=dict)  # group -> split with the step after
    forwarded: bool = False

    def calls(self) -> dict[int, GroupCall]:
        return dict(zip(self.prepared.groups, self.prepared.calls, strict=True))


@dataclass(frozen=True)
class CollisionStats:
    """Collision of a prefetched step with the step before it, on one rank's shards.

    Device tensors (int64 scalars), so that taking them forces no host read;
    sum them over ranks for global rates. Counted over the groups both steps
    look up.
    """

    rows: Tensor  # rows of C^i
    rows_next: Tensor  # rows read by step i+1
    ids: Tensor  # ids of step i+1 whose row is in C^i
    ids_next: Tensor  # ids of step i+1

    def percent(self) -> tuple[float, float]:
        """(rows %, ids %) of step i+1 that had to wait; reads the device."""
        r, rn, i, n = (int(t) for t in (self.rows, self.rows_next, self.ids, self.ids_next))
        return 100.0 * r / max(rn, 1), 100.0 * i / max(n, 1)


@dataclass
class Deferred:
    """The exclusive part of one group's update, applied later with its own step."""

    store: ShardStore
    slots: Tensor  # shard-major slots of X, arrival order
    grads: Work  # the exchange of their gradients, issued in backward
    steps: tuple[int, ...]  # per-table steps of the update it belongs to
    skip: Tensor | None = None  # the step's non-finite flag (device): then nothing changes


class PrioritizedSchedule:
    """The context that persists across steps: the prefetched steps and the stash."""

    def __init__(
        self,
        comm: Communicator,
        timer: Timer = no_timer,
        overlap: Communicator | None = None,
    ) -> None:
        # ``comm`` carries the blocking exchanges (collision gradients and rows);
        # ``overlap`` those issued ahead of their use (prefetch, deferred gradients).
        self.comm, self.timer = comm, timer
        self.overlap = overlap if overlap is not None else comm
        self.steps: deque[StepState] = deque()  # [current] or [current, next]
        self.stash: list[Deferred] = []
        self.last_stats: CollisionStats | None = None
        # The next step's lookup with only its preflight issued (two-phase prefetch):
        # `complete_pending` runs `prefetch` on it, at the latest before backward.
        self.pending: input_dist.PreparedLookup | None = None

    # ---- off the critical path ---------------------------------------------
    def prefetch(self, prepared: input_dist.PreparedLookup) -> StepState:
        """Everything about the lookup ``prepared`` that waits for no update."""
        self.check_can_prefetch()
        self.flush()
        state = StepState(prepared)
        input_dist.issue_ids(prepared, self.overlap, self.timer)
        with self.timer("ids_a2a"):
            for call in prepared.calls:
                assert call.ids_work is not None
                work, call.ids_work = call.ids_work, None
                call.receive(work.wait())
        prev = self.steps[-1].calls() if self.steps else {}
        with self.timer("collision"):
            for g, call in state.calls().items():
                if g in prev:
                    state.prev[g] = collision_link.link(self.overlap, prev[g], call)
                    self.steps[-1].next[g] = state.prev[g]
        self.last_stats = None
        if state.prev:
            total = torch.stack([lk.stats for lk in state.prev.values()]).sum(0)
            self.last_stats = CollisionStats(*total.unbind())
        for g, call in state.calls().items():
            state.exclusive[g] = self._send_exclusive(call, state.prev.get(g))
        self.steps.append(state)
        return state

    def complete_pending(self) -> None:
        if self.pending is not None:
            prepared, self.pending = self.pending, None
            self.prefetch(prepared)

    def check_can_prefetch(self) -> None:
        if len(self.steps) == 2:
            raise RuntimeError(
                "prioritized updates prefetch at most one step ahead: call backward of "
                "the current step first"
            )

    def _send_exclusive(self, call: GroupCall, lk: Link | None) -> Work:
        """Look up and send every row the next step reads, now.

        The collision rows among them are stale (step i has not updated them
        yet); forward overwrites them with the rows sent after the update. Sending
        them anyway keeps this exchange's sizes those of the ids exchange,
        known on the host: splitting off N^(i+1) would need the collision
        counts on the host here, a wait for the GPU at the start of every step.
        """
        assert call.recv_slots is not None
        with self.timer(call.store.section("lookup")):
            rows = call.store.lookup(call.recv_slots)
        return self.overlap.all_to_all_v(rows, call.recv, call.send)

    def flush(self) -> None:
        """Apply the stashed exclusive updates (a local operation: no collective)."""
        stash, self.stash = self.stash, []
        for d in stash:
            with self.timer("grad_a2a"):
                grads = d.grads.wait()
            with self.timer(d.store.section("update")):
                d.store.apply_update(d.slots, grads, d.steps, d.skip)

    def discard(self, state: StepState) -> None:
        """Drop a step that looks nothing up (no rank passed features): no backward."""
        assert self.steps and self.steps[0] is state and not state.calls()
        self.steps.popleft()

    # ---- forward -------------------------------------------------------------
    def take(self) -> StepState | None:
        """The prefetched step the next forward consumes, if any."""
        if self.steps and self.steps[0].forwarded:
            raise RuntimeError(
                "prioritized updates run one lookup per step: backpropagate through it "
                "before the next forward"
            )
        return self.steps[0] if self.steps else None

    def forward(self, state: StepState) -> tuple[Tensor, ...]:
        """Merge prefetched exclusive rows and updated collision rows, in batch order."""
        state.forwarded = True
        outputs = []
        for g, call in state.calls().items():
            with self.timer("emb_a2a"):
                rows = state.exclusive.pop(g).wait()
            if g in state.prev:
                if g not in state.collided:
                    raise RuntimeError("forward before the previous step's backward")
                with self.timer("emb_a2a_collision"):  # the part that had to wait for an update
                    collided = state.collided.pop(g).wait()
                lk = state.prev[g]
                rows = fill_marked(lk.next_send, collided, rows, lk.order(lk.next_send))
            outputs.append(ranged_combine(rows, call.plan))
        return tuple(outputs)

    # ---- backward ------------------------------------------------------------
    def backward(
        self, state: StepState, grads: tuple[Tensor, ...], guard: NonFiniteGuard | None = None
    ) -> None:
        """Collision part now (and its rows to the next step); exclusive part stashed.

        ``guard`` agrees whether the step is skipped, before any row changes."""
        if not self.steps or self.steps[0] is not state or not state.forwarded:
            raise RuntimeError("backward ran twice, or out of order, through a prioritized lookup")
        self.complete_pending()  # the next step must be split against this one first
        self.steps.popleft()
        self.flush()  # normally empty: prefetch applied it
        nxt = self.steps[0] if self.steps else None
        skip = None
        if guard is not None and state.calls():
            with self.timer("grad_a2a"):  # waits for the other ranks' backward
                skip = guard.agree(grads, state.prepared.calls[0].store.device)
        deferred: list[tuple[ShardStore, Tensor, Tensor, Link, tuple[int, ...]]] = []
        for (g, call), grad in zip(state.calls().items(), grads, strict=True):
            grad_send = apply_dispatch(grad.to(call.store.dtype).contiguous(), call.plan)
            lk = state.next.get(g)
            steps = call.store.advance(call.table_indices, skip)
            assert call.recv_slots is not None
            if lk is None:  # no next step prefetched: C is empty, update everything now
                self._update(call, call.recv_slots, grad_send, (call.send, call.recv), steps, skip)
                continue
            assert nxt is not None
            counts = lk.counts()
            g_co, g_ex = split_marked(
                grad_send, lk.now_send, sum(counts.grads_co[0]), lk.order(lk.now_send)
            )
            slots_co, slots_ex = split_marked(
                call.recv_slots, lk.now_recv, sum(counts.grads_co[1]), lk.order(lk.now_recv)
            )
            self._update(call, slots_co, g_co, counts.grads_co, steps, skip, "grad_a2a_collision")
            nxt.collided[g] = self._send_collided(lk)
            deferred.append((call.store, slots_ex, g_ex, lk, steps))
        # The exclusive gradients leave last: they are not on the critical path.
        for store, slots_ex, g_ex, lk, steps in deferred:
            work = self.overlap.all_to_all_v(g_ex, *lk.counts().grads_ex)
            self.stash.append(Deferred(store, slots_ex, work, steps, skip))

    def _update(
        self,
        call: GroupCall,
        slots: Tensor,
        grad_send: Tensor,
        counts: tuple[list[int], list[int]],
        steps: tuple[int, ...],
        skip: Tensor | None,
        section: str = "grad_a2a",
    ) -> None:
        with self.timer(section):
            grad_shard = self.comm.all_to_all_v(grad_send, *counts).wait()
        with self.timer(call.store.section("update")):
            call.store.apply_update(slots, grad_shard, steps, skip)

    def _send_collided(self, lk: Link) -> Work:
        """The updated C rows, to the requesters of the next step (their positions in order)."""
        assert lk.next.recv_slots is not None
        send, recv = lk.counts().rows_co
        # Only the marked part: one gather, not split_marked's two.
        slots = lk.next.recv_slots.index_select(0, lk.order(lk.next_recv)[: sum(send)])
        with self.timer(lk.next.store.section("lookup")):
            rows = lk.next.store.lookup(slots)
        return self.comm.all_to_all_v(rows, send, recv)


class PrioritizedLookup(torch.autograd.Function):
    """Outputs: one ``[N_g, D_g]`` batch-major embedding tensor per group call."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        anchor: Tensor,
        schedule: PrioritizedSchedule,
        state: StepState,
        guard: NonFiniteGuard | None,
    ) -> tuple[Tensor, ...]:
        ctx.schedule, ctx.state, ctx.guard = schedule, state, guard
        return schedule.forward(state)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[None, ...]:
        with torch.no_grad():
            ctx.schedule.backward(ctx.state, grads, ctx.guard)
        return None, None, None, None
