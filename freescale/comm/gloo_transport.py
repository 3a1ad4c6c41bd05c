"""`GlooTransport`: the SM-free rounds over ``torch.distributed`` gloo (TCP, any host).

Each round posts one ``isend`` per send and one ``irecv`` per receive on a gloo
group of the communicator's own (so these messages never interleave with the
trainer's collectives), then waits for all of them. Gloo matches messages of
one (sender, receiver, tag) pair in posting order, which is the pairwise
order `Transport` promises.

Device data is staged through page-locked host buffers allocated once
(``2 * (W - 1)`` slots of ``chunk_bytes``: a send slot and a receive slot per
peer, reused every round): D2H into the send slots, gloo between host
buffers, H2D out of the receive slots. CPU tensors are sent as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch import Tensor

from freescale.comm.transport import Copier, PeerError, Transfer, pinned_empty


class GlooTransport:
    """Pairwise rounds over a gloo group; ``peers`` limits which ranks it serves."""

    name = "gloo"

    def __init__(
        self,
        group: Any,
        copier: Copier,
        chunk_bytes: int,
        timeout: float,
        peers: Sequence[int] | None = None,
    ) -> None:
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._copier = copier
        self._chunk = chunk_bytes
        self._timeout = timedelta(seconds=timeout)
        peer_list = [p for p in (peers if peers is not None else range(self.world_size))]
        self._slot = {p: i for i, p in enumerate(q for q in peer_list if q != self.rank)}
        self._pool: Tensor | None = None  # allocated on the first device transfer
        self._previous: list[Any] = []

    @property
    def chunk_bytes(self) -> int:
        return self._chunk

    def _staging(self, peer: int, receive: bool) -> Tensor:
        if self._pool is None:
            self._pool = pinned_empty(2 * len(self._slot) * self._chunk, self._copier.device)
        i = 2 * self._slot[peer] + int(receive)
        return self._pool[i * self._chunk : (i + 1) * self._chunk]

    def post(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> list[Any]:
        """Start a round; pass the result to `complete`."""
        staged_sends = []
        for peer, src in sends:
            if src.is_cuda:
                host = self._staging(peer, receive=False)[: src.numel()]
                self._copier.copy(host, src)
                src = host
            staged_sends.append((peer, src))
        self._copier.fence()  # D2H done before gloo reads the slots
        pending: list[Any] = []
        for peer, dst in recvs:
            host = self._staging(peer, receive=True)[: dst.numel()] if dst.is_cuda else dst
            work = dist.irecv(host, group=self.group, group_src=peer)
            pending.append(("recv from", peer, work, dst, host))
        for peer, src in staged_sends:
            work = dist.isend(src, group=self.group, group_dst=peer)
            pending.append(("send to", peer, work, None, None))
        # Completed gloo p2p works are dropped only now, after the next round is
        # posted: dropping them right after wait() cost ~3 ms per round on
        # torch 2.13 CPU (measured; benchmarks/comm.py).
        self._previous = [work for _, _, work, _, _ in pending]
        return pending

    def complete(self, pending: list[Any]) -> None:
        """Wait for a round started by `post`; copy device receives out of staging."""
        for what, peer, work, dst, host in pending:
            try:
                work.wait(self._timeout)
            except Exception as exc:  # gloo raises RuntimeError subclasses
                raise PeerError(
                    peer, f"gloo {what} rank {peer} failed or timed out: {exc}".strip()
                ) from exc
            if dst is not None and host is not dst:
                self._copier.copy(dst, host)
        self._copier.fence()  # H2D done before the receive slots are reused

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        self.complete(self.post(sends, recvs))

    def close(self) -> None:
        self._pool = None
        self._previous = []


def new_gloo_group(timeout: float) -> Any:
    """A gloo group over all ranks of the default group (collective: every rank calls it)."""
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
