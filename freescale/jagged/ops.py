"""Vectorized reference operations on (values, offsets) jagged layouts.

These are the CPU path and the twin every fast kernel is tested against.
A jagged layout is ``values`` (first dim = total length) plus ``offsets``
(int64, ``B + 1`` entries, ``offsets[0] == 0``, non-decreasing).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import Tensor

# Waits on copy events that found the copy not done yet, by call site
# (`wait_for_copy`); `sync_debug` reports them.
BLOCKING_WAITS: Counter[str] = Counter()


def record_event(timing: bool = False) -> torch.Event:
    """A CUDA event recorded now on the current stream.

    ``torch.Event`` finds the current stream in C++; ``torch.cuda.Event.record()``
    looks it up in Python (~10 us of the launching thread per event, and the
    step records ~30). Same ``query``/``synchronize``/``wait``/``elapsed_time``.
    """
    event = torch.Event(device="cuda", enable_timing=timing)
    event.record()
    return event


_STREAMS: dict[tuple[str, int], torch.cuda.Stream] = {}


def side_stream(role: str, device: torch.device | None = None) -> torch.cuda.Stream:
    """The CUDA stream of ``role`` on ``device`` (default: the current one),
    made on first use and kept: work of one role always queues on one stream."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    key = (role, index)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(index)
    return _STREAMS[key]


def copy_to_host(t: Tensor) -> tuple[Tensor, Any]:
    """A copy of ``t`` on the host, started now without waiting: (copy, its event).

    On CUDA the copy goes to pinned memory behind the work queued so far on
    the current stream; the event (None off CUDA) is what a later reader waits
    for (`wait_for_copy`), not for whatever the stream is given in between.
    """
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host, record_event()


def wait_for_copy(event: Any, site: str) -> None:
    """Wait for a device-to-host copy's event; count it under ``site`` if it
    was not done (then the host did wait for the GPU here)."""
    if event is not None and not event.query():
        BLOCKING_WAITS[site] += 1
        event.synchronize()


def host_to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device`` without making the host wait for the GPU.

    A blocking copy from pageable memory to CUDA synchronizes the stream: the
    host stalls until every queued kernel has run, and the GPU then idles
    while the host catches up. From pinned memory the copy is only queued.
    """
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def lengths_to_offsets(lengths: Tensor) -> Tensor:
    """Exclusive prefix sum with a leading zero, as int64."""
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths.reshape(-1).to(torch.int64), dim=0, out=offsets[1:])
    return offsets


def offsets_to_lengths(offsets: Tensor) -> Tensor:
    return offsets[1:] - offsets[:-1]


def segment_ids(offsets: Tensor, total: int | None = None) -> Tensor:
    """Segment index of every value position (``[0, 0, 1, 2, 2, ...]``), int64.

    A binary search of each position in the segment starts: three small kernels
    on a GPU, where ``repeat_interleave`` of the lengths takes five. It searches the
    whole ``offsets`` (Inductor before torch 2.12 searched a sliced one from
    the slice's base: pytorch#182343) and clamps to ``[0, B - 1]``, a no-op on
    valid offsets that lets compiled code index with it safely (pytorch#186536:
    an unprovable bound becomes a device assert under dynamic shapes). A
    ``total`` past ``offsets[-1]`` names its extra positions ``B - 1``."""
    if total is None:
        total = int(offsets[-1])
    positions = torch.arange(total, device=offsets.device, dtype=offsets.dtype)
    found = torch.searchsorted(offsets, positions, right=True) - 1
    return found.clamp_(0, max(offsets.numel() - 2, 0))


def gather_positions(
    offsets: Tensor, indices: Tensor, total: int | None = None
) -> tuple[Tensor, Tensor]:
    """Positions into ``values`` that ``select(indices)`` reads, and the new offsets.

    ``total`` (the output length) may be given by a caller that already knows
    it, so that no device value is read back on the host.
    """
    indices = indices.to(device=offsets.device, dtype=torch.int64)
    starts = offsets[:-1][indices]
    sel_lengths = offsets[1:][indices] - starts
    new_offsets = lengths_to_offsets(sel_lengths)
    if total is None:
        total = int(new_offsets[-1])
    seg = torch.repeat_interleave(
        torch.arange(indices.numel(), device=offsets.device), sel_lengths, output_size=total
    )
    positions = torch.arange(total, device=offsets.device) - new_offsets[seg] + starts[seg]
    return positions, new_offsets


def concat_offsets(offsets_list: list[Tensor]) -> Tensor:
    """Offsets of several jagged layouts laid end to end."""
    if not offsets_list:
        return torch.zeros(1, dtype=torch.int64)
    pieces = [offsets_list[0]]
    base = offsets_list[0][-1]
    for offsets in offsets_list[1:]:
        pieces.append(offsets[1:] + base)
        base = base + offsets[-1]
    return torch.cat(pieces)


def check_offsets(offsets: Tensor, values_len: int, what: str) -> None:
    """Raise ValueError unless ``offsets`` is a valid layout for ``values_len`` values."""
    if offsets.dtype != torch.int64 or offsets.dim() != 1 or offsets.numel() < 1:
        raise ValueError(f"{what}: offsets must be a 1-D int64 tensor with B+1 >= 1 entries")
    if int(offsets[0]) != 0:
        raise ValueError(f"{what}: offsets[0] must be 0, got {int(offsets[0])}")
    if offsets.numel() > 1 and bool((offsets[1:] < offsets[:-1]).any()):
        bad = int(torch.nonzero(offsets[1:] < offsets[:-1])[0])
        raise ValueError(f"{what}: offsets decrease at segment {bad} (negative length)")
    if int(offsets[-1]) != values_len:
        raise ValueError(
            f"{what}: offsets end at {int(offsets[-1])} but there are {values_len} values"
        )
