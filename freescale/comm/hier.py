"""Several hosts: shared memory inside a host, NIXL or gloo between hosts (paper Fig. 6).

`RoutedTransport` sends each pair's bytes the cheapest way: through the shm
transport when both ranks share a host, through the remote transport
otherwise (`NixlTransport` where NIXL is installed, else `GlooTransport`;
both halves of a round run at once: the remote half is posted first and
completed last). AllToAll uses it as is.

`hierarchical_all_gather` is the AllGather of Fig. 6, rail-aligned. With H
hosts of L ranks each, the ranks with local index l on every host form a
ring ("rail" l). For each chunk of the input:

    1. ring:  H-1 steps over rail l; in step s a rank passes the piece it
              received in step s-1 (its own in step 0) to the next host,
              so every rank ends with the chunk of all H ranks of its rail;
    2. host:  one shm round per host h: every rank broadcasts the piece of
              rail member h to its L-1 neighbours, which gives each rank the
              pieces of all L rails, i.e. of all W = H*L ranks.

Each inter-host link carries (H-1)/H of the data once per rail, so all L
ranks of a host drive the network at once, and no piece crosses a host
boundary twice. Everything runs in host memory: on a GPU the chunk is
copied D2H once, the W pieces come back H2D once. Chunks bound the host
memory (W pieces of one chunk); the phases of one chunk run one after the
other (no overlap of chunk k's ring with chunk k-1's host phase yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from torch import Tensor

from freescale.comm.shm_transport import ShmTransport
from freescale.comm.topology import Topology
from freescale.comm.transport import Copier, Transfer, pinned_empty, split


class SplitRound(Protocol):
    """A transport whose round can be started and finished apart (gloo, nixl)."""

    name: str

    @property
    def chunk_bytes(self) -> int: ...

    def post(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> Any: ...

    def complete(self, pending: Any) -> None: ...

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None: ...

    def close(self) -> None: ...


class RoutedTransport:
    """shm for ranks of this host, ``remote`` for the others (see module doc).

    Its name is ``hier`` with gloo between hosts, ``hier-nixl`` with NIXL.
    """

    def __init__(self, shm: ShmTransport, remote: SplitRound, local_ranks: Sequence[int]) -> None:
        self.shm, self.remote = shm, remote
        self.name = "hier" if remote.name == "gloo" else f"hier-{remote.name}"
        self._local = set(local_ranks)

    @property
    def chunk_bytes(self) -> int:
        return min(self.shm.chunk_bytes, self.remote.chunk_bytes)

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        pending = self.remote.post(
            [t for t in sends if t[0] not in self._local],
            [t for t in recvs if t[0] not in self._local],
        )
        self.shm.exchange(
            [t for t in sends if t[0] in self._local], [t for t in recvs if t[0] in self._local]
        )
        self.remote.complete(pending)

    def close(self) -> None:
        self.shm.close()
        self.remote.close()


def hierarchical_all_gather(
    routed: RoutedTransport,
    topo: Topology,
    rank: int,
    copier: Copier,
    x: Tensor,
    out: Tensor,
    chunk_bytes: int,
) -> None:
    """``out[g*n:(g+1)*n] = x of rank g`` for all g (flat uint8 views; see module doc)."""
    n, world = x.numel(), len(topo.hosts)
    hosts = sorted(set(topo.hosts))
    rails = [topo.ranks_of(h) for h in hosts]  # rails[h][l]: rank with local index l on host h
    me_h, me_l = topo.hosts[rank], topo.local_index(rank)
    rail = [rails[h][me_l] for h in hosts]
    nxt, prv = rail[(me_h + 1) % len(hosts)], rail[(me_h - 1) % len(hosts)]
    neighbours = [g for g in rails[me_h] if g != rank]
    on_device = x.is_cuda or out.is_cuda
    chunk = max(1, min(chunk_bytes, n))
    host = pinned_empty(world * chunk, copier.device) if on_device else None
    for a, b in split(n, chunk_bytes):
        m = b - a

        def piece(g: int, a: int = a, b: int = b, m: int = m) -> Tensor:
            # Host memory of rank g's piece of this chunk: out itself on the CPU.
            return host[g * m : (g + 1) * m] if host is not None else out[g * n + a : g * n + b]

        copier.copy(piece(rank), x[a:b])
        copier.fence()
        H = len(hosts)
        for s in range(H - 1):
            send_g, recv_g = rail[(me_h - s) % H], rail[(me_h - s - 1) % H]
            routed.remote.exchange([(nxt, piece(send_g))], [(prv, piece(recv_g))])
        for h in hosts:
            src = piece(rails[h][me_l])
            routed.shm.exchange(
                [(q, src) for q in neighbours],
                [(q, piece(rails[h][topo.local_index(q)])) for q in neighbours],
            )
        if host is not None:
            for g in range(world):
                copier.copy(out[g * n + a : g * n + b], piece(g))
            copier.fence()  # the staging is reused by the next chunk
