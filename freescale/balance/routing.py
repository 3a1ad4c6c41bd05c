"""`Routing`: one rank's share of a plan, derived on the host with no communication.

From the world lengths and the plan every rank knows, for every rank pair and
every jagged level (samples, UIH values, candidates, content values), how many
rows go from one to the other. So stage III needs no counts exchange, and a
receiver builds its offsets from the gathered lengths instead of receiving
them. Arrival order: rank s's samples for rank d leave s in s's local order
and sources arrive in rank order, so a destination receives its samples in
ascending global index; ``final_order`` then puts them in the plan's order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from freescale.balance.plan import Plan
from freescale.balance.world import WorldLengths


@dataclass(frozen=True)
class Routing:
    """What rank ``rank`` sends and receives for one plan.

    - ``send_order``: permutation of the local samples that groups them by
      destination (stable), or None when they are grouped already;
    - ``send_counts`` / ``recv_counts``: per level, rows to / from each rank;
    - ``moving``: per level, whether any rank sends any row of it to another
      rank (the same on every rank, so a level nobody moves can skip its
      collective everywhere);
    - ``recv_*``: the lengths of the received samples, in arrival order;
    - ``final_order``: arrival position of each output sample, or None when
      the plan's order is the arrival order.
    """

    rank: int
    send_order: Tensor | None
    send_counts: dict[str, list[int]]
    recv_counts: dict[str, list[int]]
    moving: dict[str, bool]
    recv_uih_lengths: Tensor
    recv_num_candidates: Tensor
    recv_candidate_lengths: Tensor
    final_order: Tensor | None


def _is_sorted(t: Tensor) -> bool:
    return t.numel() < 2 or bool((t[1:] >= t[:-1]).all())


def route(world: WorldLengths, plan: Plan, rank: int) -> Routing:
    """The routing of ``rank`` (plan assumed valid: see `check_plan`)."""
    w = world.world_size
    if not 0 <= rank < w:
        raise ValueError(f"rank {rank} outside [0, {w})")
    dest = plan.dest()
    pair = world.source_ranks() * w + dest
    sizes = {
        "samples": torch.ones_like(dest),
        "uih": world.uih_lengths,
        "candidates": world.num_candidates,
        "content": world.content_per_sample(),
    }
    send, recv, moving = {}, {}, {}
    for level, size in sizes.items():
        traffic = torch.zeros(w * w, dtype=torch.int64).index_add_(0, pair, size).view(w, w)
        send[level] = traffic[rank].tolist()
        recv[level] = traffic[:, rank].tolist()
        moving[level] = int(traffic.sum()) != int(traffic.diagonal().sum())

    off = world.rank_offsets()
    local_dest = dest[int(off[rank]) : int(off[rank + 1])]
    send_order = None if _is_sorted(local_dest) else torch.sort(local_dest, stable=True).indices

    mine = plan.samples_of(rank)
    arrival = torch.sort(mine).values
    final_order = None if _is_sorted(mine) else torch.searchsorted(arrival, mine)
    return Routing(
        rank=rank,
        send_order=send_order,
        send_counts=send,
        recv_counts=recv,
        moving=moving,
        recv_uih_lengths=world.uih_lengths[arrival],
        recv_num_candidates=world.num_candidates[arrival],
        recv_candidate_lengths=world.candidate_lengths_of(arrival),
        final_order=final_order,
    )
