"""An in-process fake world: N simulated ranks driven by threads.

For unit tests of components that talk to a `Communicator`: no process
group, no sockets, deterministic results. Each rank's k-th collective meets
the other ranks' k-th collective; a mismatch (different op, dtypes, row
shapes, or send/recv counts that do not pair up) raises on every rank that
waits on it, where a real backend would hang or corrupt data. One failing
rank aborts the world so that the others raise instead of waiting forever.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from freescale.comm.protocol import check_counts


class FakeWorldAborted(RuntimeError):
    """Raised in ranks still waiting when another rank failed."""


@dataclass
class _Posted:
    kind: str
    x: Tensor
    send: list[int] = field(default_factory=list)
    recv: list[int] = field(default_factory=list)


class FakeWorld:
    """Shared state of ``world_size`` simulated ranks (one `FakeCommunicator` each)."""

    def __init__(self, world_size: int, timeout: float = 60.0) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._slots: dict[int, list[_Posted | None]] = {}
        self._fetched: dict[int, int] = {}
        self._abort: str | None = None

    def communicator(self, rank: int, device: torch.device | str = "cpu") -> FakeCommunicator:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        return FakeCommunicator(self, rank, torch.device(device))

    def abort(self, reason: str) -> None:
        with self._cond:
            self._abort = reason
            self._cond.notify_all()

    def _post(self, seq: int, rank: int, op: _Posted) -> None:
        with self._cond:
            slots = self._slots.setdefault(seq, [None] * self.world_size)
            slots[rank] = op
            self._cond.notify_all()

    def _collect(self, seq: int, rank: int) -> Tensor:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: self._abort is not None or None not in self._slots[seq], self.timeout
            )
            if self._abort is not None:
                raise FakeWorldAborted(f"fake world aborted: {self._abort}")
            if not ok:
                missing = [r for r, s in enumerate(self._slots[seq]) if s is None]
                raise TimeoutError(f"collective #{seq}: ranks {missing} never joined")
            slots: list[_Posted] = list(self._slots[seq])  # type: ignore[arg-type]
            self._fetched[seq] = self._fetched.get(seq, 0) + 1
            if self._fetched[seq] == self.world_size:
                del self._slots[seq], self._fetched[seq]
        return _result(slots, rank, seq)


def _result(slots: list[_Posted], rank: int, seq: int) -> Tensor:
    kinds = {s.kind for s in slots}
    layouts = {(s.x.dtype, tuple(s.x.shape[1:])) for s in slots}
    if len(kinds) != 1 or len(layouts) != 1:
        raise RuntimeError(
            f"collective #{seq}: ranks disagree on op/dtype/row shape: {kinds} {layouts}"
        )
    if slots[0].kind == "all_gather":
        if len({s.x.shape[0] for s in slots}) != 1:
            raise RuntimeError(f"collective #{seq}: all_gather needs equal shapes on all ranks")
        return torch.cat([s.x.to(slots[rank].x.device) for s in slots])
    pieces = []
    for src, s in enumerate(slots):
        if s.send[rank] != slots[rank].recv[src]:
            raise RuntimeError(
                f"collective #{seq}: rank {src} sends {s.send[rank]} rows to rank {rank},"
                f" which expects {slots[rank].recv[src]}"
            )
        start = sum(s.send[:rank])
        pieces.append(s.x[start : start + s.send[rank]].to(slots[rank].x.device))
    return torch.cat(pieces)


class FakeWork:
    def __init__(self, world: FakeWorld, seq: int, rank: int) -> None:
        self._world, self._seq, self._rank = world, seq, rank
        self._output: Tensor | None = None

    def wait(self, stream: torch.Stream | None = None) -> Tensor:
        if self._output is None:
            self._output = self._world._collect(self._seq, self._rank)
        return self._output


class FakeCommunicator:
    """One simulated rank of a `FakeWorld`; implements `Communicator`."""

    def __init__(self, world: FakeWorld, rank: int, device: torch.device) -> None:
        self._world, self._rank, self._device = world, rank, device
        self._seq = 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world.world_size

    @property
    def device(self) -> torch.device:
        return self._device

    def _issue(self, op: _Posted) -> FakeWork:
        seq, self._seq = self._seq, self._seq + 1
        self._world._post(seq, self._rank, op)
        return FakeWork(self._world, seq, self._rank)

    def all_gather(self, x: Tensor) -> FakeWork:
        # Inputs are copied at issue time: a real backend may read them any time
        # before wait(), and the copy makes reuse-before-wait bugs harmless here
        # rather than flaky.
        return self._issue(_Posted("all_gather", x.detach().clone()))

    def all_to_all_v(
        self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]
    ) -> FakeWork:
        send, recv = check_counts(x, send_counts, recv_counts, self.world_size)
        return self._issue(_Posted("all_to_all_v", x.detach().clone(), send, recv))


def run_threads(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    device: torch.device | str | Sequence[torch.device | str] = "cpu",
    timeout: float = 60.0,
) -> list[Any]:
    """Call ``fn(comm, *args)`` on ``world_size`` threads; return per-rank results.

    ``device`` may be one device or one per rank. CUDA ranks need a device each:
    autograd runs all backward work of one device on a single engine thread, so
    two thread-ranks doing backward collectives on one GPU would deadlock.
    The first exception raised by any rank is re-raised here (after the other
    ranks were released by aborting the world).
    """
    devices = [device] * world_size if isinstance(device, str | torch.device) else list(device)
    if len(devices) != world_size:
        raise ValueError(f"need one device per rank, got {len(devices)} for {world_size}")
    world = FakeWorld(world_size, timeout=timeout)
    results: list[Any] = [None] * world_size
    errors: list[tuple[int, BaseException]] = []

    def body(rank: int) -> None:
        try:
            device = torch.device(devices[rank])
            if device.type == "cuda":  # like a real rank: kernels launch on its device
                torch.cuda.set_device(device)
            results[rank] = fn(world.communicator(rank, device), *args)
        except BaseException as exc:
            errors.append((rank, exc))
            world.abort(f"rank {rank} raised {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5.0)
    if any(t.is_alive() for t in threads):
        world.abort("run_threads timed out")
        raise TimeoutError(f"fake ranks did not finish within {timeout:.0f} s")
    if errors:
        first = [e for e in errors if not isinstance(e[1], FakeWorldAborted)] or errors
        raise first[0][1]
    return results
