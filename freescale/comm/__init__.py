"""Communicator protocol and backends (layer 1).

- `Communicator` / `Work`: the interface (see `freescale.comm.protocol`).
- `TorchCommunicator`: ``torch.distributed`` (NCCL on GPU, gloo on CPU).
- `SmFreeCommunicator`: copy engines + host transports, no GPU kernels
  (`freescale.comm.smfree`; transports `shm`, `gloo`, `hier`; docs/comm.md).
- `make_communicator(name, device)`: any of them by name (`BACKENDS`).
- `FakeWorld` / `run_threads`: N simulated ranks in one process, for tests.
- `exchange_counts`: the counts exchange that precedes a variable AllToAll.
"""

from freescale.comm.factory import BACKENDS, TRANSPORTS, make_communicator
from freescale.comm.fake import FakeCommunicator, FakeWorld, FakeWorldAborted, run_threads
from freescale.comm.protocol import (
    Communicator,
    CompletedWork,
    Work,
    check_counts,
    exchange_counts,
)
from freescale.comm.smfree import SmFreeCommunicator, SmFreeWork
from freescale.comm.topology import Topology, detect_topology
from freescale.comm.torch_backend import TorchCommunicator, TorchWork
from freescale.comm.transport import PeerError, Transport

__all__ = [
    "BACKENDS",
    "TRANSPORTS",
    "Communicator",
    "CompletedWork",
    "FakeCommunicator",
    "FakeWorld",
    "FakeWorldAborted",
    "PeerError",
    "SmFreeCommunicator",
    "SmFreeWork",
    "Topology",
    "TorchCommunicator",
    "TorchWork",
    "Transport",
    "Work",
    "check_counts",
    "detect_topology",
    "exchange_counts",
    "make_communicator",
    "run_threads",
]
