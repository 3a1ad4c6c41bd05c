"""`make_communicator`: a Communicator by name (the trainer's ``comm_backend`` key).

Names (`BACKENDS`):

- ``torch``: `TorchCommunicator` (NCCL on GPU, gloo on CPU);
- ``smfree``: `SmFreeCommunicator` with the transport picked by topology:
  one host -> ``shm``, several hosts -> ``hier``, one rank -> ``gloo``;
- ``smfree-shm`` / ``smfree-gloo`` / ``smfree-hier``: that transport forced.

``smfree-rdma`` names the unimplemented RDMA slot and is refused like any
unknown name: a ValueError whose one line lists the alternatives.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from freescale.comm.gloo_transport import GlooTransport, new_gloo_group
from freescale.comm.hier import RoutedTransport, hierarchical_all_gather
from freescale.comm.shm_transport import ShmTransport
from freescale.comm.smfree import DEFAULT_TIMEOUT, SmFreeCommunicator
from freescale.comm.topology import Topology, detect_topology
from freescale.comm.torch_backend import TorchCommunicator
from freescale.comm.transport import Copier, Transport

TRANSPORTS = ("shm", "gloo", "hier")
BACKENDS = ("torch", "smfree", *(f"smfree-{t}" for t in TRANSPORTS))
DEFAULT_POOL_BYTES = 64 << 20
_SLOTS = 2  # shm slots per peer: chunk k+1 is written while chunk k is read


def make_communicator(
    backend: str,
    device: torch.device | str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    pool_bytes: int = DEFAULT_POOL_BYTES,
    ranks_per_host: int | None = None,
) -> Any:
    """Build the named Communicator on ``device`` (collective: every rank calls it).

    ``timeout``: seconds a peer may stay silent before a collective fails
    naming it. ``pool_bytes``: host buffer budget per rank (shared segment
    and/or pinned staging); larger messages are sent in chunks.
    ``ranks_per_host``: emulate hosts of that many ranks (tests); default:
    torchrun's variables (`freescale.comm.topology`).
    """
    if backend not in BACKENDS:
        extra = " (the RDMA transport is an unimplemented slot)" if "rdma" in backend else ""
        raise ValueError(
            f"unknown comm backend {backend!r}{extra}; choose one of: {', '.join(BACKENDS)}"
        )
    if backend == "torch":
        return TorchCommunicator(device=device)
    if pool_bytes < 4096:
        raise ValueError(f"pool_bytes must be >= 4096, got {pool_bytes}")
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    group = new_gloo_group(timeout)
    topo = detect_topology(group, ranks_per_host)
    name = backend.partition("-")[2] or _auto(topo)
    if name == "shm" and topo.num_hosts > 1:
        raise ValueError(
            f"comm backend smfree-shm needs one host, found {topo.num_hosts} ({topo.source});"
            " choose one of: smfree, smfree-hier, smfree-gloo"
        )
    copier = Copier(dev)
    rank = dist.get_rank()
    transport, gather = _transport(name, group, topo, rank, copier, timeout, pool_bytes)
    return SmFreeCommunicator(transport, copier, gather)


def _auto(topo: Topology) -> str:
    if len(topo.hosts) == 1:
        return "gloo"
    return "shm" if topo.num_hosts == 1 else "hier"


def _chunk(pool_bytes: int, parts: int) -> int:
    """The pool cut into ``parts`` chunks, a multiple of 4 KiB (at least 4 KiB)."""
    return max(4096, (pool_bytes // max(parts, 1)) // 4096 * 4096)


def _transport(
    name: str,
    group: Any,
    topo: Topology,
    rank: int,
    copier: Copier,
    timeout: float,
    pool_bytes: int,
) -> tuple[Transport, Any]:
    world = len(topo.hosts)
    local = topo.local_ranks(rank)
    if name == "gloo":
        return GlooTransport(group, copier, _chunk(pool_bytes, 2 * (world - 1)), timeout), None
    shm = ShmTransport(group, local, copier, _chunk(pool_bytes, len(local) * _SLOTS), timeout)
    if name == "shm":
        return shm, None
    remote = [g for g in range(world) if g not in local]
    gloo = GlooTransport(group, copier, _chunk(pool_bytes, 2 * len(remote)), timeout, remote)
    routed = RoutedTransport(shm, gloo, local)
    if not topo.uniform() or topo.num_hosts == 1:
        return routed, None  # flat pairwise AllGather (hosts of different sizes)
    chunk = min(routed.chunk_bytes, _chunk(pool_bytes, world))

    def gather(c: Copier, xb: torch.Tensor, ob: torch.Tensor) -> None:
        hierarchical_all_gather(routed, topo, rank, c, xb, ob, chunk)

    return routed, gather
