"""Validate every rank's lookup input and exchange AllToAll counts, in one collective.

Each rank computes, per request (feature), a status ``[code, value, aux]``
on the device (no host sync), keeps the first bad one, and adds a fingerprint
of its feature keys and its per-group send counts. One ``exchange_counts``
call carries all of it: rank d receives from every rank s the fingerprint and
first bad status of s and the number of ids s sends to d. After it, every rank knows
whether *any* rank's input is bad, and all of them raise the same ValueError
naming the table, the rank and the offending value, before any id or
embedding is exchanged and before any update. No rank is left waiting in a
collective that the others skipped.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

from freescale.comm import Communicator, Work, exchange_counts
from freescale.embedding._ops import first_bad
from freescale.embedding.config import TableConfig
from freescale.jagged.ops import copy_to_host, host_to_device, wait_for_copy

OK, OUT_OF_RANGE, LENGTH_MISMATCH, BAD_OFFSETS, NOT_INTEGER, BAD_SHAPE, UNKNOWN_FEATURE = range(7)
_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


@dataclass
class Request:
    """One input feature of a lookup call, routed to one table."""

    key: str
    table: TableConfig
    group: int
    slot_table: int  # index of the table inside its group's store
    ids: Tensor  # flat int64 on the store device (empty when malformed)
    offsets: Tensor | None  # jagged input: offsets passed back unchanged
    shape: tuple[int, ...]  # tensor input: the ids' shape, restored on output
    host_status: tuple[int, int, int] | None = None


def make_request(
    key: str,
    table: TableConfig,
    group: int,
    slot_table: int,
    ids: Tensor,
    offsets: Tensor | None,
    device: torch.device,
) -> Request:
    """Build a request; structural problems become a status instead of raising here."""
    status = None
    if ids.dtype not in _INT_DTYPES:
        status = (NOT_INTEGER, 0, 0)
    elif offsets is not None and (
        ids.dim() != 1 or offsets.dim() != 1 or offsets.numel() < 1 or offsets.dtype != torch.int64
    ):
        status = (BAD_SHAPE, ids.dim(), offsets.numel())
    shape = tuple(ids.shape)
    flat = ids.reshape(-1).to(device=device, dtype=torch.int64) if status is None else None
    if flat is None:
        flat = torch.zeros(0, dtype=torch.int64, device=device)
        offsets = None
    elif offsets is not None:
        offsets = offsets.to(device)
    return Request(key, table, group, slot_table, flat, offsets, shape, status)


def _status(req: Request) -> Tensor:
    device = req.ids.device
    if req.host_status is not None:
        return torch.tensor(req.host_status, dtype=torch.int64, device=device)
    n = req.ids.numel()
    zero = torch.zeros((), dtype=torch.int64, device=device)
    code, value = zero, zero
    if n and req.table.dynamic is None:  # a dynamic table takes any int64 id
        has_bad, first = first_bad(req.ids, req.table.rows)
        code = torch.where(has_bad, OUT_OF_RANGE, code)
        value = torch.where(has_bad, first, value)
    if req.offsets is not None:
        off = req.offsets
        lengths = off[1:] - off[:-1]
        min_len = lengths.min() if lengths.numel() else zero
        start_bad = off[0] != 0
        structure_bad = start_bad | (min_len < 0)
        code = torch.where(structure_bad, BAD_OFFSETS, code)
        value = torch.where(structure_bad, torch.where(start_bad, off[0], min_len), value)
        sum_bad = off[-1] != n
        code = torch.where(sum_bad, LENGTH_MISMATCH, code)
        value = torch.where(sum_bad, off[-1], value)
    return torch.stack([code, value, torch.full_like(zero, n)])


def _message(requests: list[Request], src: int, summary: list[int], unknown: list[str]) -> str:
    idx, code, value, aux = summary
    if code == UNKNOWN_FEATURE:
        names = f" {unknown}" if unknown else ""
        return f"rank {src} looked up feature(s){names} that no table declares"
    req = requests[idx]
    where = f"table {req.table.name!r} (feature {req.key!r}): rank {src}"
    if code == OUT_OF_RANGE:
        return f"{where} looked up id {value}, outside [0, {req.table.rows})"
    if code == LENGTH_MISMATCH:
        return f"{where} passed lengths summing to {value} for {aux} ids"
    if code == BAD_OFFSETS:
        return f"{where} passed offsets with start/negative length {value} (must start at 0)"
    if code == NOT_INTEGER:
        return f"{where} passed ids of a non-integer dtype"
    return f"{where} passed malformed jagged ids (ids dim {value}, {aux} offsets; need 1-D)"


def _summary(requests: list[Request], unknown: list[str], device: torch.device) -> Tensor:
    """[request index, code, value, aux] of the first bad request (code 0 if none)."""
    if unknown or not requests:
        code = UNKNOWN_FEATURE if unknown else OK
        return torch.tensor([0, code, 0, 0], dtype=torch.int64, device=device)
    status = torch.stack([_status(q) for q in requests])  # [R, 3]
    first = (status[:, 0] != OK).to(torch.uint8).argmax().reshape(1)
    # index_select: ``status[first]`` with a device index reads it back to the host.
    return torch.cat([first, status.index_select(0, first)[0]])


def fingerprint(keys: list[str]) -> int:
    """Same on every rank iff the ranks look up the same feature keys."""
    return zlib.crc32("\0".join(sorted(keys)).encode())


_CONSTANTS: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def _constant_on(values: tuple[int, ...], device: torch.device) -> Tensor:
    """``values`` (int64) on ``device``, copied there once: the same ones come
    every step (the key fingerprint, the head of checked inputs), and each
    copy of a fresh host tensor is a host-to-device transfer on the step's
    path. Read-only: callers only read it."""
    cached = _CONSTANTS.get((values, device))
    if cached is None:
        cached = host_to_device(torch.tensor(values, dtype=torch.int64), device)
        if len(_CONSTANTS) < 64:  # a handful of key sets per program
            _CONSTANTS[(values, device)] = cached
    return cached


@dataclass
class PendingPreflight:
    """An issued preflight exchange; `finish_preflight` reads it on the host."""

    work: Work
    keys: list[str]
    requests: list[Request]
    unknown: list[str]
    send_counts: Tensor
    rank: int
    # CUDA: [received, own counts] copied to pinned memory when issued, and its event.
    host_copy: tuple[Tensor, object] | None = None


def start_preflight(
    comm: Communicator,
    keys: list[str],
    requests: list[Request],
    unknown: list[str],
    send_counts: Tensor,
    check_ids: bool = True,
) -> PendingPreflight:
    """Issue the check of all ranks' inputs + counts exchange; nothing blocks.

    ``send_counts`` is this rank's ``[W, G]`` count of ids per owner for each
    of the collection's G groups. The payload has a fixed width (5 + G), so
    even ranks that disagree on the keys meet in a well-formed collective.
    ``check_ids=False`` (ids and offsets checked by the caller on the host)
    skips the ids' range and offsets checks; keys and host-known problems
    are still checked.
    """
    w, device = comm.world_size, send_counts.device
    key = fingerprint(keys)
    if check_ids or unknown or any(q.host_status is not None for q in requests):
        head = torch.cat([_constant_on((key,), device), _summary(requests, unknown, device)])
    else:  # nothing to check on the device: the same head every step
        head = _constant_on((key, 0, OK, 0, 0), device)
    payload = torch.cat([head.reshape(1, 5).expand(w, 5), send_counts.to(torch.int64)], dim=1)
    work = exchange_counts(comm, payload)
    host_copy = None
    if device.type == "cuda" and getattr(work, "stream_ordered", False):
        # Start the device-to-host copy now, ordered after the exchange only:
        # reading it later waits for this event, not for whatever the compute
        # stream is given in between (sdd reads it after forward). Only where
        # ``wait`` orders the stream: a host-blocking wait here would stall
        # the start of the step.
        host_copy = copy_to_host(_with_own_counts(work.wait(), send_counts))
    return PendingPreflight(work, keys, requests, unknown, send_counts, comm.rank, host_copy)


def _with_own_counts(received: Tensor, send_counts: Tensor) -> Tensor:
    """What arrived and this rank's own counts, flat: read back in one copy."""
    return torch.cat([received.flatten(), send_counts.t().flatten().to(received.dtype)])


def finish_preflight(p: PendingPreflight) -> tuple[list[list[int]], list[list[int]]]:
    """Wait for the exchange; return per-group host (send, recv) counts.

    Raises ValueError on every rank if any rank's input is bad.
    """
    width = 5 + p.send_counts.shape[1]
    if p.host_copy is not None:
        host, event = p.host_copy
        wait_for_copy(event, "preflight counts")
        both = host.tolist()
    else:
        both = _with_own_counts(p.work.wait(), p.send_counts).tolist()
    n = width * p.send_counts.shape[0]
    received = [both[i : i + width] for i in range(0, n, width)]
    own = both[n:]
    for src, row in enumerate(received):
        if row[0] != received[p.rank][0]:
            raise ValueError(
                f"ranks {p.rank} and {src} looked up different feature keys"
                f" (this rank: {sorted(p.keys)}); every rank must pass the same keys"
            )
    for src, row in enumerate(received):
        if row[2] != OK:
            raise ValueError(_message(p.requests, src, row[1:5], p.unknown))
    groups, w = p.send_counts.shape[1], p.send_counts.shape[0]
    sends = [own[g * w : (g + 1) * w] for g in range(groups)]
    recvs = [[row[5 + g] for row in received] for g in range(p.send_counts.shape[1])]
    return sends, recvs
