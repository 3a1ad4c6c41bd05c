"""The slot for an RDMA host transport (ibverbs / UCX / MPI). Not implemented, unmeasured.

The paper's inter-host path (§3.3, Fig. 6) moves host-staged chunks with
CPU-driven RDMA; here gloo over TCP stands in for it. An RDMA transport only
has to implement `freescale.comm.transport.Transport`:

- ``chunk_bytes``: the size of its registered (``ibv_reg_mr``) host buffers,
  which should also be ``cudaHostRegister``-ed so D2H/H2D land in them;
- ``exchange(sends, recvs)``: post one RDMA write (or send) per transfer to
  the peer's pre-exchanged buffer, then wait for the completions; pairwise
  FIFO order per peer, a timeout naming the peer, as the other transports;
- ``close()``: deregister and free.

Any number quoted for this transport must come from a measurement on real
hardware; until then ``docs/comm.md`` lists it as unmeasured.
"""

from __future__ import annotations

from typing import Any


class RdmaTransport:
    """Placeholder: constructing it raises NotImplementedError (see module doc)."""

    name = "rdma"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(
            "the RDMA transport of the smfree backend is not implemented (an unmeasured slot,"
            " see freescale/comm/rdma.py); use transport 'shm' inside a host, 'gloo' or 'hier'"
            " across hosts"
        )
