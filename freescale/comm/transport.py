"""Host transports of the SM-free backend: the interface and the copy helper they share.

A transport moves bytes between ranks with the CPU and the copy engines only.
Its one primitive is a *round* of point-to-point transfers:

    transport.exchange(sends=[(peer, src), ...], recvs=[(peer, dst), ...])

``src`` and ``dst`` are contiguous 1-D ``uint8`` tensors of at most
``chunk_bytes`` bytes each, on the CPU or on the communicator's GPU. The call
blocks (on the helper thread of `SmFreeCommunicator`, never on the training
thread) until every ``dst`` holds its bytes and every ``src`` may be reused.
Messages between one pair of ranks are matched in the order they were
exchanged, so both sides must split a message into the same chunks: the
communicator derives every chunk size from host counts both sides know.

Why pairwise rounds rather than collectives: a message larger than the
transport's buffers is cut into chunks, and each pair of ranks may need a
different number of chunks (uneven AllToAll). Pairwise matching needs no
global agreement on the number of rounds.

Device memory is moved by `Copier`: on the GPU it is a ``cudaMemcpyAsync`` on
a copy stream (a contiguous same-dtype ``copy_``, which launches no kernel),
followed by an event the host waits on before it tells a peer that a buffer
is ready or may be reused. On the CPU it is a plain ``copy_``.

Failures: every blocking step has a timeout. A peer that closed its
connection (exited) or sent nothing for ``timeout`` seconds makes
`exchange` raise `PeerError` naming that peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

Transfer = tuple[int, Tensor]  # (peer rank, contiguous 1-D uint8 tensor)


class PeerError(RuntimeError):
    """A peer died, stalled past the timeout, or sent something unexpected."""

    def __init__(self, peer: int, message: str) -> None:
        super().__init__(f"peer rank {peer}: {message}")
        self.peer = peer


@runtime_checkable
class Transport(Protocol):
    """Pairwise byte rounds between the ranks of one communicator (see module doc)."""

    name: str

    @property
    def chunk_bytes(self) -> int:
        """Largest ``src``/``dst`` one transfer may carry."""
        ...

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        """Run one round of transfers; return when all are done (see module doc)."""
        ...

    def close(self) -> None:
        """Free buffers and connections; idempotent."""
        ...


def as_bytes(x: Tensor) -> Tensor:
    """A contiguous tensor's storage as a flat ``uint8`` view (no copy)."""
    if not x.is_contiguous():
        raise ValueError("as_bytes needs a contiguous tensor")
    return x.reshape(-1).view(torch.uint8)


def split(total: int, chunk: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` cutting ``total`` bytes into pieces of ``chunk`` (none if 0)."""
    return [(a, min(a + chunk, total)) for a in range(0, total, chunk)]


class Copier:
    """Copies between host and device buffers on copy streams, with host fences.

    One per communicator, used by its helper thread only. ``begin(event)``
    makes both copy streams wait for the producer's event (recorded on the
    caller's stream when the collective was issued: the input is written and
    the output's memory is free from then on). ``copy`` enqueues a D2H or H2D
    copy (or copies on the CPU); ``fence`` blocks the host until everything
    enqueued so far is done, which is what makes a staging buffer safe to
    publish to a peer or to reuse. ``done_event`` is what the consumer waits on.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._d2h: torch.cuda.Stream | None = None
        self._h2d: torch.cuda.Stream | None = None
        self._pending = False
        if self.cuda:
            self._d2h = torch.cuda.Stream(device)
            self._h2d = torch.cuda.Stream(device)

    def begin(self, producer: torch.cuda.Event | None) -> None:
        if producer is not None and self._d2h is not None and self._h2d is not None:
            self._d2h.wait_event(producer)
            self._h2d.wait_event(producer)

    def copy(self, dst: Tensor, src: Tensor) -> None:
        if dst.numel() != src.numel():
            raise RuntimeError(f"copy of {src.numel()} bytes into {dst.numel()}")
        if not (dst.is_cuda or src.is_cuda):
            dst.copy_(src)
            return
        # A contiguous uint8 -> uint8 copy_ is one cudaMemcpyAsync: no kernel.
        stream = self._h2d if dst.is_cuda and not src.is_cuda else self._d2h
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        self._pending = True

    def fence(self) -> None:
        """Block the host until every copy enqueued so far has completed."""
        if self._pending and self._d2h is not None and self._h2d is not None:
            self._d2h.synchronize()  # releases the GIL while it waits
            self._h2d.synchronize()
        self._pending = False

    def done_event(self) -> torch.cuda.Event | None:
        """An event after all copies so far (None on the CPU)."""
        if self._h2d is None or self._d2h is None:
            return None
        event = torch.cuda.Event()
        self._h2d.wait_stream(self._d2h)
        event.record(self._h2d)
        return event


def pinned_empty(nbytes: int, device: torch.device) -> Tensor:
    """A host ``uint8`` staging buffer: page-locked when ``device`` is a GPU."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def register_host(buf: Tensor) -> bool:
    """Page-lock existing host memory (a shared segment) for async copies; True if done."""
    if buf.numel() == 0:
        return False
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {buf.numel()} bytes failed with error {err}")
    return True


def unregister_host(buf: Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
