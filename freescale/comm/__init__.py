"""Communicator protocol and backends (layer 1).

- `Communicator` / `Work`: the interface (see `freescale.comm.protocol`).
- `TorchCommunicator`: ``torch.distributed`` (NCCL on GPU, gloo on CPU).
- `FakeWorld` / `run_threads`: N simulated ranks in one process, for tests.
- `exchange_counts`: the counts exchange that precedes a variable AllToAll.
"""

from freescale.comm.fake import FakeCommunicator, FakeWorld, FakeWorldAborted, run_threads
from freescale.comm.protocol import (
    Communicator,
    CompletedWork,
    Work,
    check_counts,
    exchange_counts,
)
from freescale.comm.torch_backend import TorchCommunicator, TorchWork

__all__ = [
    "Communicator",
    "CompletedWork",
    "FakeCommunicator",
    "FakeWorld",
    "FakeWorldAborted",
    "TorchCommunicator",
    "TorchWork",
    "Work",
    "check_counts",
    "exchange_counts",
    "run_threads",
]
