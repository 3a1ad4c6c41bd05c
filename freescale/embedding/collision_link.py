"""The collision split of one group between two consecutive lookups
(the rows prioritized embedding updates must wait for).

Given the slots one shard serves in step i (``now``) and step i+1 (``next``),
the owner finds C^i = I^i ∩ I^(i+1) (each position's slot searched in the
other step's sorted slots, `owner_marks`; its twin `owner_marks_reference`
goes through `freescale.kernels.collision_split`) and marks, per *received
position* (shard-major, arrival order):

- ``now_recv``: step-i positions whose row is in C^i: their gradients are
  exchanged and applied in step i's backward; the others (X^i) are deferred;
- ``next_recv``: step-(i+1) positions whose row is in C^i: their rows are sent
  after step i's update; the others (N^(i+1)) are looked up and sent now.

The marks travel back to the requesters with the counts of the ids exchange
(an AllToAll of one byte per id), so each requester knows the same split of its
own send buffer (``now_send``, ``next_send``). A mark is per row: all
duplicates of a row fall on the same side, in their arrival order, which is
what keeps every row's gradient sum identical to the synchronous one.

Every AllToAll of a part needs its counts per peer on the host: `Link.counts`
is the one place they are read (see there). Nothing here reads a size back
from the device: the marks come from a sort and a binary search whose sizes
are the received id counts (`owner_marks`; `owner_marks_reference` is its
twin through ``torch.unique``, which reads the unique count back).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from freescale.comm import Communicator
from freescale.embedding.lookup import GroupCall, issue_exchange
from freescale.jagged.ops import copy_to_host, host_to_device, wait_for_copy
from freescale.kernels import collision_split
from freescale.kernels.backend import choose_impl, triton_module
from freescale.kernels.collision import positions_in


@dataclass
class HostCounts:
    """Per-peer host counts of the four AllToAlls of the split parts."""

    grads_co: tuple[list[int], list[int]]  # (send, recv): collision gradients, step i
    grads_ex: tuple[list[int], list[int]]  # exclusive gradients, step i (deferred)
    rows_co: tuple[list[int], list[int]]  # updated collision rows, to step i+1


@dataclass
class Link:
    """The split of one group between step i (``now``) and step i+1 (``next``)."""

    now: GroupCall
    next: GroupCall
    now_recv: Tensor  # [R_i] bool, owner side
    next_recv: Tensor  # [R_i+1] bool, owner side
    now_send: Tensor  # [S_i] bool, requester side
    next_send: Tensor  # [S_i+1] bool, requester side
    per_peer: Tensor  # [4, W] int64: now_recv, next_recv, now_send, next_send summed per peer
    stats: Tensor  # [4] int64: collision rows, rows of step i+1, collision ids, ids of step i+1
    _copy: tuple[Tensor, Any] | None = None  # (pinned host copy of per_peer, its event)
    _host: HostCounts | None = None
    _orders: dict[int, Tensor] = field(default_factory=dict)  # id(mark) -> marked_first(mark)

    def __post_init__(self) -> None:
        self._copy = copy_to_host(self.per_peer)

    def counts(self) -> HostCounts:
        """The split's per-peer counts on the host, read once and cached.

        HOST READ: the only device-to-host read of the prioritized schedule.
        ``per_peer`` was copied to pinned memory without waiting when the
        split was made (in `prefetch`, at the start of step i); the first use
        is step i's backward, so the copy's event is long done and the host
        does not wait for the GPU's queued work.
        """
        if self._host is None:
            assert self._copy is not None
            host, event = self._copy
            wait_for_copy(event, "collision split counts (backward)")
            now_r, next_r, now_s, next_s = host.tolist()
            sub = _minus
            self._host = HostCounts(
                grads_co=(now_s, now_r),
                grads_ex=(sub(self.now.send, now_s), sub(self.now.recv, now_r)),
                rows_co=(next_r, next_s),
            )
        return self._host

    def order(self, mark: Tensor) -> Tensor:
        """`marked_first` of one of this link's marks, sorted once however often
        it splits (at one rank the requester's marks are the owner's: one sort
        serves the gradients and the slots)."""
        key = id(mark)
        if key not in self._orders:
            self._orders[key] = marked_first(mark)
        return self._orders[key]


def _minus(a: list[int], b: list[int]) -> list[int]:
    return [x - y for x, y in zip(a, b, strict=True)]


def link(comm: Communicator, now: GroupCall, nxt: GroupCall) -> Link:
    """Split on the owner, then tell every requester which of its positions collide."""
    assert now.recv_slots is not None and nxt.recv_slots is not None
    now_recv, next_recv, stats = owner_marks(
        now.recv_slots, nxt.recv_slots, _sorted_recv(now), _sorted_recv(nxt)
    )
    # Marks go back like embeddings: receive counts become send counts.
    now_work = issue_exchange(comm, now_recv.to(torch.uint8), now.recv, now.send)
    next_work = issue_exchange(comm, next_recv.to(torch.uint8), nxt.recv, nxt.send)
    now_send, next_send = now_work.wait().bool(), next_work.wait().bool()
    per_peer = sums_per_peer(
        [now_recv, next_recv, now_send, next_send], [now.recv, nxt.recv, now.send, nxt.send]
    )
    return Link(now, nxt, now_recv, next_recv, now_send, next_send, per_peer, stats)


def _sorted_recv(call: GroupCall) -> Tensor:
    """``call.recv_slots`` sorted, once: a step is the next of one link and the
    now of the following one."""
    cached = call.sorted_recv
    if cached is None or cached[0] is not call.recv_slots:
        assert call.recv_slots is not None
        call.sorted_recv = cached = (call.recv_slots, torch.sort(call.recv_slots).values)
    return cached[1]


def owner_marks(
    slots_now: Tensor,
    slots_next: Tensor,
    sorted_now: Tensor | None = None,
    sorted_next: Tensor | None = None,
    impl: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per received position, whether its row is in C = I^i ∩ I^(i+1); and the stats.

    A row is in C iff it occurs in both steps: each position looks its slot up
    in the other step's sorted slots (duplicates included, so no unique set
    and no size read back). The stats count distinct rows as the first
    position of each run of equal slots in sorted order. ``sorted_now`` /
    ``sorted_next``: the slots sorted, when the caller has them. On CUDA one
    Triton launch (`freescale.kernels.triton_collision.owner_marks_triton`)
    does the rest.
    """
    if sorted_now is None:
        sorted_now = torch.sort(slots_now).values
    if sorted_next is None:
        sorted_next = torch.sort(slots_next).values
    if choose_impl(impl, slots_now.device) == "triton":
        return triton_module("collision").owner_marks_triton(
            slots_now, slots_next, sorted_now, sorted_next
        )
    now_mark = _in_sorted(slots_now, sorted_next)
    next_mark = _in_sorted(slots_next, sorted_now)
    first_next = _run_starts(sorted_next)
    stats = torch.stack(
        [
            (first_next & _in_sorted(sorted_next, sorted_now)).sum(),
            first_next.sum(),
            next_mark.sum(),
            torch.full((), slots_next.numel(), dtype=torch.int64, device=slots_now.device),
        ]
    )
    return now_mark, next_mark, stats


def _in_sorted(x: Tensor, sorted_hay: Tensor) -> Tensor:
    """``x[k] in sorted_hay`` for every k (ascending, repeats allowed)."""
    return positions_in(x, sorted_hay) >= 0


def _run_starts(sorted_x: Tensor) -> Tensor:
    """True at the first position of each run of equal values."""
    starts = torch.ones(sorted_x.shape, dtype=torch.bool, device=sorted_x.device)
    starts[1:] = sorted_x[1:] != sorted_x[:-1]
    return starts


def owner_marks_reference(slots_now: Tensor, slots_next: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """`owner_marks` through ``torch.unique`` and `collision_split` (the twin)."""
    rows_now, inv_now = torch.unique(slots_now, sorted=True, return_inverse=True)
    rows_next, inv_next = torch.unique(slots_next, sorted=True, return_inverse=True)
    split = collision_split(rows_now, rows_next)
    now_mark = (split.now_to_next >= 0)[inv_now]
    next_mark = (split.next_to_now >= 0)[inv_next]
    stats = torch.stack(
        [
            (split.next_to_now >= 0).sum(),
            torch.full((), rows_next.numel(), dtype=torch.int64, device=slots_now.device),
            next_mark.sum(),
            torch.full((), slots_next.numel(), dtype=torch.int64, device=slots_now.device),
        ]
    )
    return now_mark, next_mark, stats


def sum_per_peer(mark: Tensor, counts: list[int]) -> Tensor:
    """Marked positions per peer, for a buffer laid out as ``counts[0]`` rows of peer 0, ...

    A prefix sum read at the peers' boundaries: a scatter-add would send every
    position to one of W counters (a deterministic scatter then serializes on
    them: ~17 ms per call for 300K ids on an H200).
    """
    return sums_per_peer([mark], [counts])[0]


def sums_per_peer(marks: list[Tensor], counts: list[list[int]]) -> Tensor:
    """``[len(marks), W]``: `sum_per_peer` of each (mark, counts) pair, in one pass.

    One prefix sum over the marks laid end to end and one host-to-device copy
    of all the boundaries, instead of one of each per mark (each boundary list
    is a fresh tensor copied to the device: four per link and step). Integer
    sums: the counts are the same exactly.
    """
    device = marks[0].device
    total = sum(m.numel() for m in marks)
    prefix = torch.zeros(total + 1, dtype=torch.int64, device=device)
    torch.cumsum(torch.cat(marks).to(torch.int64), 0, out=prefix[1:])
    bounds: list[int] = []
    start = 0
    for mark, peer_counts in zip(marks, counts, strict=True):
        bounds.append(start)
        for c in peer_counts:
            bounds.append(bounds[-1] + c)
        start += mark.numel()
    at = prefix.index_select(0, host_to_device(torch.tensor(bounds, dtype=torch.int64), device))
    at = at.view(len(marks), -1)
    return at[:, 1:] - at[:, :-1]


def marked_first(mark: Tensor) -> Tensor:
    """Positions of ``mark``, the marked ones first, each part in its order.

    A stable sort of the marks instead of boolean indexing: the split point
    comes from a host count, so nothing is read back from the device.
    """
    return torch.sort((~mark).to(torch.uint8), stable=True).indices


def split_marked(
    x: Tensor, mark: Tensor, marked: int, order: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(rows of ``x`` where ``mark``, the other rows), each in their order in ``x``.

    ``marked``: the host count of marks; ``order``: `marked_first` of ``mark``
    when the caller has it already.
    """
    order = marked_first(mark) if order is None else order
    return x.index_select(0, order[:marked]), x.index_select(0, order[marked:])


def fill_marked(
    mark: Tensor, on_marked: Tensor, full: Tensor, order: Tensor | None = None
) -> Tensor:
    """``full`` with its marked rows replaced, in order, by ``on_marked``."""
    order = marked_first(mark) if order is None else order
    return full.index_copy(0, order[: on_marked.shape[0]], on_marked)
