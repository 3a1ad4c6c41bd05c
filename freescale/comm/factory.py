"""`make_communicator`: a Communicator by name (the trainer's ``comm_backend`` key).

Names (`BACKENDS`):

- ``torch``: `TorchCommunicator` (NCCL on GPU, gloo on CPU);
- ``smfree``: `SmFreeCommunicator` with the transport picked by topology:
  one host -> ``shm``, several hosts -> ``hier-nixl`` (shm inside, NIXL
  between) where NIXL is installed, else ``hier`` (shm inside, gloo between),
  one rank -> ``gloo``; the communicator's ``why`` says which and why;
- ``smfree-shm`` / ``smfree-gloo`` / ``smfree-hier`` / ``smfree-nixl``: that
  transport forced (``nixl``: between every pair, UCX picks shm or the
  network itself). Without NIXL, ``smfree-nixl`` is a ValueError naming
  what to install.

An unknown name is a ValueError whose one line lists the alternatives.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from freescale.comm.gloo_transport import GlooTransport, new_gloo_group
from freescale.comm.hier import RoutedTransport, hierarchical_all_gather
from freescale.comm.nixl_support import INSTALL_HINT, missing_message, nixl_installed
from freescale.comm.shm_transport import ShmTransport
from freescale.comm.smfree import DEFAULT_TIMEOUT, SmFreeCommunicator
from freescale.comm.topology import Topology, detect_topology
from freescale.comm.torch_backend import TorchCommunicator
from freescale.comm.transport import Copier, Transport

TRANSPORTS = ("shm", "gloo", "hier", "nixl")
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
    staging: str = "auto",
    nixl_backend: str = "UCX",
) -> Any:
    """Build the named Communicator on ``device`` (collective: every rank calls it).

    ``timeout``: seconds a peer may stay silent before a collective fails
    naming it. ``pool_bytes``: host buffer budget per rank (shared segment
    and/or pinned staging); larger messages are sent in chunks.
    ``ranks_per_host``: emulate hosts of that many ranks (tests); default:
    torchrun's variables (`freescale.comm.topology`). ``staging`` (host |
    device | auto) and ``nixl_backend`` (UCX | LIBFABRIC): where the NIXL
    transport's buffers live and which engine moves them
    (`freescale.comm.nixl_support`).
    """
    if backend not in BACKENDS:
        extra = " (RDMA: smfree-nixl)" if "rdma" in backend else ""
        raise ValueError(
            f"unknown comm backend {backend!r}{extra}; choose one of: {', '.join(BACKENDS)}"
        )
    if backend == "smfree-nixl" and not nixl_installed():
        raise ValueError(missing_message("comm backend smfree-nixl"))
    if backend == "torch":
        return TorchCommunicator(device=device)
    if pool_bytes < 4096:
        raise ValueError(f"pool_bytes must be >= 4096, got {pool_bytes}")
    dev = torch.device(device if device is not None else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    group = new_gloo_group(timeout)
    topo = detect_topology(group, ranks_per_host)
    name, why = (backend.partition("-")[2], "forced") if backend != "smfree" else _auto(topo)
    if name == "shm" and topo.num_hosts > 1:
        raise ValueError(
            f"comm backend smfree-shm needs one host, found {topo.num_hosts} ({topo.source});"
            " choose one of: smfree, smfree-hier, smfree-gloo"
        )
    copier = Copier(dev)
    rank = dist.get_rank()
    options = _Options(timeout, pool_bytes, staging, nixl_backend)
    transport, gather = _transport(name, group, topo, rank, copier, options)
    return SmFreeCommunicator(transport, copier, gather, why=why)


class _Options(NamedTuple):
    timeout: float
    pool_bytes: int
    staging: str
    nixl_backend: str


def _auto(topo: Topology) -> tuple[str, str]:
    """The transport ``smfree`` picks for ``topo``, and why."""
    if len(topo.hosts) == 1:
        return "gloo", "one rank"
    if topo.num_hosts == 1:
        return "shm", f"one host ({topo.source})"
    hosts = f"{topo.num_hosts} hosts ({topo.source})"
    if nixl_installed():
        return "hier-nixl", f"{hosts}: shm inside a host, NIXL between hosts"
    return "hier", f"{hosts}: shm inside, gloo between; NIXL is not installed: {INSTALL_HINT}"


def _chunk(pool_bytes: int, parts: int) -> int:
    """The pool cut into ``parts`` chunks, a multiple of 4 KiB (at least 4 KiB)."""
    return max(4096, (pool_bytes // max(parts, 1)) // 4096 * 4096)


def _nixl(group: Any, peers: list[int], copier: Copier, o: _Options) -> Any:
    from freescale.comm.nixl_transport import NixlTransport  # imports NIXL

    # Per peer: _SLOTS receive slots and one send slot.
    chunk = _chunk(o.pool_bytes, (_SLOTS + 1) * len(peers))
    store = dist.distributed_c10d._get_default_store()  # the run's own: no new port
    return NixlTransport(
        group, store, peers, copier, chunk, o.timeout, backend=o.nixl_backend, staging=o.staging
    )


def _transport(
    name: str, group: Any, topo: Topology, rank: int, copier: Copier, o: _Options
) -> tuple[Transport, Any]:
    world, timeout, pool_bytes = len(topo.hosts), o.timeout, o.pool_bytes
    local = topo.local_ranks(rank)
    if name == "gloo":
        return GlooTransport(group, copier, _chunk(pool_bytes, 2 * (world - 1)), timeout), None
    if name == "nixl":
        return _nixl(group, [g for g in range(world) if g != rank], copier, o), None
    shm = ShmTransport(group, local, copier, _chunk(pool_bytes, len(local) * _SLOTS), timeout)
    if name == "shm":
        return shm, None
    remote = [g for g in range(world) if g not in local]
    if name == "hier-nixl":
        between: Any = _nixl(group, remote, copier, o)
    else:
        between = GlooTransport(group, copier, _chunk(pool_bytes, 2 * len(remote)), timeout, remote)
    routed = RoutedTransport(shm, between, local)
    if not topo.uniform() or topo.num_hosts == 1:
        return routed, None  # flat pairwise AllGather (hosts of different sizes)
    chunk = min(routed.chunk_bytes, _chunk(pool_bytes, world))

    def gather(c: Copier, xb: torch.Tensor, ob: torch.Tensor) -> None:
        hierarchical_all_gather(routed, topo, rank, c, xb, ob, chunk)

    return routed, gather
