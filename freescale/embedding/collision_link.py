"""The collision split of one group between two consecutive lookups (DESIGN §5).

Given the slots one shard serves in step i (``now``) and step i+1 (``next``),
the owner finds C^i = I^i ∩ I^(i+1) with `freescale.kernels.collision_split`
and marks, per *received position* (shard-major, arrival order):

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
is the one place they are read (see there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from freescale.comm import Communicator
from freescale.embedding.lookup import GroupCall
from freescale.jagged.ops import host_to_device
from freescale.kernels import collision_split


@dataclass
class HostCounts:
    """Per-peer host counts of the four AllToAlls of the split parts."""

    grads_co: tuple[list[int], list[int]]  # (send, recv): collision gradients, step i
    grads_ex: tuple[list[int], list[int]]  # exclusive gradients, step i (deferred)
    rows_co: tuple[list[int], list[int]]  # updated collision rows, to step i+1
    rows_ex: tuple[list[int], list[int]]  # prefetched N^(i+1) rows, to step i+1


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
    _host: HostCounts | None = None

    def counts(self) -> HostCounts:
        """The split's per-peer counts on the host, read once and cached.

        HOST READ: the only device-to-host read of the prioritized schedule. It
        happens in `prefetch`, when the N^(i+1) rows are sent (the first
        AllToAll that needs them); backward reuses the cached values. On a GPU
        this waits for the split; the plan is to copy ``per_peer`` to pinned
        memory when it is computed and read it here, a change local to this
        method.
        """
        if self._host is None:
            now_r, next_r, now_s, next_s = self.per_peer.tolist()
            sub = _minus
            self._host = HostCounts(
                grads_co=(now_s, now_r),
                grads_ex=(sub(self.now.send, now_s), sub(self.now.recv, now_r)),
                rows_co=(next_r, next_s),
                rows_ex=(sub(self.next.recv, next_r), sub(self.next.send, next_s)),
            )
        return self._host


def _minus(a: list[int], b: list[int]) -> list[int]:
    return [x - y for x, y in zip(a, b, strict=True)]


def link(comm: Communicator, now: GroupCall, nxt: GroupCall) -> Link:
    """Split on the owner, then tell every requester which of its positions collide."""
    assert now.recv_slots is not None and nxt.recv_slots is not None
    now_recv, next_recv, stats = owner_marks(now.recv_slots, nxt.recv_slots)
    # Marks go back like embeddings: receive counts become send counts.
    now_work = comm.all_to_all_v(now_recv.to(torch.uint8), now.recv, now.send)
    next_work = comm.all_to_all_v(next_recv.to(torch.uint8), nxt.recv, nxt.send)
    now_send, next_send = now_work.wait().bool(), next_work.wait().bool()
    per_peer = torch.stack(
        [
            sum_per_peer(now_recv, now.recv),
            sum_per_peer(next_recv, nxt.recv),
            sum_per_peer(now_send, now.send),
            sum_per_peer(next_send, nxt.send),
        ]
    )
    return Link(now, nxt, now_recv, next_recv, now_send, next_send, per_peer, stats)


def owner_marks(slots_now: Tensor, slots_next: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per received position, whether its row is in C = I^i ∩ I^(i+1); and the stats.

    ``torch.unique`` gives the sorted row sets `collision_split` needs (on a GPU
    it reads the number of unique rows back to the host: a sync, off the
    critical path in `prefetch`).
    """
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
    """Marked positions per peer, for a buffer laid out as ``counts[0]`` rows of peer 0, ..."""
    device = mark.device
    lengths = host_to_device(torch.tensor(counts, dtype=torch.int64), device)
    peer = torch.repeat_interleave(
        torch.arange(len(counts), device=device), lengths, output_size=mark.numel()
    )
    return torch.zeros(len(counts), dtype=torch.int64, device=device).index_add_(
        0, peer, mark.to(torch.int64)
    )


def split_marked(x: Tensor, mark: Tensor, marked: int) -> tuple[Tensor, Tensor]:
    """(rows of ``x`` where ``mark``, the other rows), each in their order in ``x``.

    A stable sort of the marks instead of boolean indexing: the sizes come from
    the host count ``marked``, so nothing is read back from the device.
    """
    order = torch.sort((~mark).to(torch.uint8), stable=True).indices
    return x.index_select(0, order[:marked]), x.index_select(0, order[marked:])


def merge_marked(mark: Tensor, on_marked: Tensor, others: Tensor) -> Tensor:
    """Inverse of `split_marked`: ``on_marked`` rows where ``mark``, ``others`` elsewhere."""
    order = torch.sort((~mark).to(torch.uint8), stable=True).indices
    rows = torch.cat([on_marked, others])
    out = torch.empty_like(rows)
    out[order] = rows
    return out
