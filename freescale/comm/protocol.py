"""The Communicator protocol: the one interface for non-reducing collectives.

The balancer, the sharded embeddings and every later component talk to this
interface only, so that backends (``torch`` NCCL/gloo, SM-free, copy-engine,
the in-process fake used by unit tests) can be swapped without touching them.

Semantics shared by all backends:

- Collectives are *issued* by a call and *completed* by ``Work.wait``. The call
  returns at once; ``wait(stream)`` orders ``stream`` (default: the current
  one) after the collective and returns the output tensor. On the GPU it does
  not block the host; on the CPU (gloo) it blocks until the data is there.
- ``all_to_all_v`` counts are host-side integers in rows of ``x``'s first
  dimension: ``send_counts[d]`` rows go to rank ``d`` (taken from ``x`` in
  rank order), ``recv_counts[s]`` rows arrive from rank ``s``. Both sides must
  agree; `exchange_counts` is how a receiver learns its counts.
- Every rank must issue the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class Work(Protocol):
    """Handle of an issued collective."""

    def wait(self, stream: torch.Stream | None = None) -> Tensor:
        """Order ``stream`` (default: current) after the collective; return its output."""
        ...


@runtime_checkable
class Communicator(Protocol):
    """Non-reducing collectives over a fixed group of ``world_size`` ranks."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def device(self) -> torch.device:
        """Device that collective inputs and outputs live on."""
        ...

    def all_gather(self, x: Tensor) -> Work:
        """Concatenate every rank's ``x`` (equal shapes) along dim 0, in rank order."""
        ...

    def all_to_all_v(
        self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]
    ) -> Work:
        """Send ``x``'s rows to ranks by ``send_counts``; receive ``sum(recv_counts)`` rows."""
        ...


class CompletedWork:
    """A `Work` whose output already exists (local shortcuts, tests)."""

    def __init__(self, output: Tensor) -> None:
        self._output = output

    def wait(self, stream: torch.Stream | None = None) -> Tensor:
        return self._output


def check_counts(
    x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], world_size: int
) -> tuple[list[int], list[int]]:
    """Validate host counts of an ``all_to_all_v`` call; return them as int lists.

    Raises ValueError on the calling rank *before* anything is issued, so a
    malformed call cannot leave a half-posted collective behind.
    """
    send = [int(c) for c in send_counts]
    recv = [int(c) for c in recv_counts]
    if len(send) != world_size or len(recv) != world_size:
        raise ValueError(
            f"all_to_all_v needs {world_size} send and recv counts, got {len(send)} and {len(recv)}"
        )
    if min(send) < 0 or min(recv) < 0:
        raise ValueError(f"all_to_all_v counts must be >= 0, got send={send} recv={recv}")
    if x.dim() < 1 or sum(send) != x.shape[0]:
        rows = x.shape[0] if x.dim() else "a 0-d tensor"
        raise ValueError(f"send_counts sum to {sum(send)} but x has {rows} rows")
    return send, recv


def exchange_counts(comm: Communicator, send_counts: Tensor) -> Work:
    """Issue the counts exchange that precedes a variable AllToAll.

    ``send_counts`` is ``[W]`` or ``[W, K]`` (int64, on ``comm.device``): row
    ``d`` is what this rank will send to rank ``d`` (K independent exchanges
    may share one call). ``wait()`` returns the same shape, row ``s`` being
    what rank ``s`` will send here. Reading it on the host (``.tolist()``) is
    the one unavoidable device-to-host sync of a variable AllToAll.
    """
    w = comm.world_size
    if send_counts.dim() not in (1, 2) or send_counts.shape[0] != w:
        raise ValueError(f"send_counts must be [{w}] or [{w}, K], got {tuple(send_counts.shape)}")
    ones = [1] * w
    return comm.all_to_all_v(send_counts.contiguous(), ones, ones)
