"""`TorchCommunicator`: collectives through ``torch.distributed`` (NCCL or gloo).

Every call is issued with ``async_op=True``. With NCCL, ``Work.wait`` makes the
given stream wait for the NCCL stream and returns at once; with gloo (CPU) it
blocks until the data has arrived. Variable AllToAll maps onto
``all_to_all_single`` with split sizes, which gloo supports with uneven and
zero splits (checked on torch 2.13 CPU, covered by tests/comm).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from freescale.comm.protocol import check_counts


class TorchWork:
    """Wraps a ``torch.distributed`` work handle and the output it fills."""

    # On CUDA, ``wait`` orders the stream after the collective; the host does not block.
    stream_ordered = True

    def __init__(self, handle: Any, output: Tensor, inputs: tuple[Tensor, ...]) -> None:
        self._handle = handle
        self._output = output
        self._inputs = inputs  # kept alive until the collective is waited on

    def wait(self, stream: torch.Stream | None = None) -> Tensor:
        if self._handle is not None:
            if stream is not None and self._output.is_cuda:
                with torch.cuda.stream(stream):
                    self._handle.wait()
                self._output.record_stream(stream)
            else:
                self._handle.wait()
            self._handle = None
            self._inputs = ()
        return self._output


class LocalWork:
    """One rank's collective: its output is a copy of its input, made on the
    issuing stream (the NCCL call would make the same copy after ~0.1 ms of
    host bookkeeping per call). ``wait`` orders the given stream after it."""

    stream_ordered = True

    def __init__(self, output: Tensor) -> None:
        self._output = output
        self._event = None
        if output.is_cuda:  # torch.Event: the current stream is found in C++, not Python
            self._event = torch.Event(device=output.device)
            self._event.record()

    def wait(self, stream: torch.Stream | None = None) -> Tensor:
        if self._event is not None:
            self._event.wait(stream)  # None: the current stream
            if stream is not None:
                self._output.record_stream(stream)
            self._event = None
        return self._output


def _default_device(group: Any) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TorchCommunicator:
    """A `Communicator` over a ``torch.distributed`` process group.

    ``group`` defaults to the default group; ``device`` defaults to the current
    CUDA device for NCCL groups and to the CPU otherwise.
    """

    def __init__(self, group: Any = None, device: torch.device | str | None = None) -> None:
        if not dist.is_initialized():
            raise ValueError("TorchCommunicator needs an initialized torch.distributed group")
        self.group = group
        self._rank = dist.get_rank(group)
        self._world_size = dist.get_world_size(group)
        self._device = torch.device(device) if device is not None else _default_device(group)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return self._device

    def all_gather(self, x: Tensor) -> TorchWork | LocalWork:
        if self._world_size == 1:
            return LocalWork(x.clone(memory_format=torch.contiguous_format))
        x = x.contiguous()
        out = x.new_empty((self._world_size * x.shape[0], *x.shape[1:]))
        # ``all_gather_single`` replaces the deprecated name in newer torch.
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        handle = gather(out, x, group=self.group, async_op=True)
        return TorchWork(handle, out, (x,))

    def all_to_all_v(
        self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]
    ) -> TorchWork | LocalWork:
        send, recv = check_counts(x, send_counts, recv_counts, self._world_size)
        if self._world_size == 1:  # recv == send: the rows stay here
            return LocalWork(x.clone(memory_format=torch.contiguous_format))
        x = x.contiguous()
        out = x.new_empty((sum(recv), *x.shape[1:]))
        handle = dist.all_to_all_single(
            out,
            x,
            output_split_sizes=recv,
            input_split_sizes=send,
            group=self.group,
            async_op=True,
        )
        return TorchWork(handle, out, (x,))


def end_process_groups() -> None:
    """Destroy every process group and free them now, not at interpreter exit.

    ``destroy_process_group`` only forgets the groups: a trainer's reference
    cycles keep them until the exit's last garbage collection, where a gloo
    worker thread that drops a finished collective's tensors cannot take the
    GIL and the rank dies by SIGABRT with its work done ("terminate called
    without an active exception"). Collected here, their destructors join
    those threads while the interpreter is whole. (A forked or forkserver
    child ends by ``os._exit``, no finalization: the test harness needs none.)
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
