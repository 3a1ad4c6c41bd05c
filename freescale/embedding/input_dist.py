"""The parameter-free first half of a sharded lookup, startable a step early.

A lookup's input distribution (validate + counts exchange, then the ids
AllToAll) does not depend on any embedding value, so a pipeline may run it
for batch i+1 while batch i computes (TorchRec's "sparse data dist"). It has
three phases, each a no-op if already done:

1. `start`: route ids to owners, issue the preflight exchange (no blocking);
2. `issue_ids`: read the counts on the host, issue the ids AllToAll;
3. the lookup itself (`ShardedLookup`) waits for the ids and continues.

Doing the phases early changes *when* collectives run, never what they
compute: results are bit-identical to doing all three in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from freescale.comm import Communicator
from freescale.embedding.lookup import GroupCall, Timer, route
from freescale.embedding.preflight import (
    PendingPreflight,
    Request,
    finish_preflight,
    start_preflight,
)
from freescale.embedding.store import ShardStore


@dataclass
class PreparedLookup:
    keys: list[str]
    requests: list[Request]
    groups: list[int]
    calls: list[GroupCall]
    pending: PendingPreflight | None
    ids_issued: bool = False

    def matches(self, keys: list[str], sizes: dict[str, tuple[int, ...]]) -> bool:
        return self.keys == keys and all(q.shape == sizes[q.key] for q in self.requests)

    def same_ids(self, requests: list[Request]) -> bool:
        by_key = {q.key: q.ids for q in requests}
        return all(torch.equal(q.ids, by_key[q.key]) for q in self.requests)


def start(
    comm: Communicator,
    stores: list[ShardStore],
    keys: list[str],
    requests: list[Request],
    unknown: list[str],
    device: torch.device,
    checked: bool = False,
    learns: bool = True,
    behind: bool = False,
) -> PreparedLookup:
    """Phase 1. ``checked``: the caller vouches for the ids and offsets (host
    checks), so the device check is skipped; with one rank nothing is then
    exchanged and the counts are the ids' sizes (no host read at all).
    ``learns``: the call will be trained through (a dynamic table gives its
    new ids rows; otherwise it only reads, ``behind``: as the table was before
    a call mapped ahead of its step)."""
    by_group: dict[int, list[Request]] = {}
    for q in requests:
        by_group.setdefault(q.group, []).append(q)
    w = comm.world_size
    groups = sorted(by_group)
    calls = [route(stores[g], by_group[g], w) for g in groups]
    for call in calls:
        call.comm, call.learns, call.behind = comm, learns, behind
    structural = unknown or any(q.host_status is not None for q in requests)
    if checked and w == 1 and not structural:  # raising those needs the preflight
        for call in calls:
            n = sum(call.sizes)
            call.send, call.recv = [n], [n]
        return PreparedLookup(keys, requests, groups, calls, None)
    counts = torch.zeros(w, len(stores), dtype=torch.int64, device=device)
    for g, call in zip(groups, calls, strict=True):
        counts[:, g] = call.send_counts
    pending = start_preflight(comm, keys, requests, unknown, counts, check_ids=not checked)
    return PreparedLookup(keys, requests, groups, calls, pending)


def finish_counts(prepared: PreparedLookup, timer: Timer) -> None:
    if prepared.pending is None:
        return
    with timer("preflight"):
        sends, recvs = finish_preflight(prepared.pending)
    prepared.pending = None
    for g, call in zip(prepared.groups, prepared.calls, strict=True):
        call.send, call.recv = sends[g], recvs[g]


def issue_ids(prepared: PreparedLookup, comm: Communicator, timer: Timer) -> None:
    finish_counts(prepared, timer)
    if prepared.ids_issued:
        return
    for call in prepared.calls:
        call.ids_work = comm.all_to_all_v(call.send_slots, call.send, call.recv)
    prepared.ids_issued = True


def request_sizes(requests: list[Request]) -> dict[str, tuple[int, ...]]:
    return {q.key: q.shape for q in requests}
