"""A `SampleBatch` as one buffer: its tensors laid end to end in one uint8 tensor.

A DataLoader worker hands each tensor to the trainer through its own
shared-memory file descriptor: on the trainer's side a socket connection and
an authentication handshake per tensor, on a thread that takes the GIL from
the launch thread; then every tensor is pinned and copied to the device on
its own. Packed, a batch is one descriptor, one pinned buffer and one
host-to-device copy, and its tensors come back as views of that buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from freescale.jagged.batch import SampleBatch

ALIGN = 16  # bytes; every view starts at a multiple of its dtype's size


@dataclass(frozen=True)
class Spec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offset in the buffer


@dataclass(frozen=True)
class PackedBatch:
    """``data``: the bytes; ``specs``: one per tensor, in `SampleBatch.tensors` order."""

    data: Tensor
    specs: tuple[Spec, ...]
    uih: tuple[str, ...]  # feature names of each jagged part
    candidates: tuple[str, ...]
    content: tuple[str, ...]
    has_dense: bool

    def pin_memory(self) -> PackedBatch:
        """What `torch.utils.data.DataLoader`'s pin thread calls (one pinned copy)."""
        if not torch.cuda.is_available():
            return self
        return PackedBatch(self.data.pin_memory(), *self._rest())

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        return PackedBatch(self.data.to(device, non_blocking=non_blocking), *self._rest())

    def _rest(self) -> tuple:
        return self.specs, self.uih, self.candidates, self.content, self.has_dense

    def unpack(self) -> SampleBatch:
        """The batch, its tensors views of ``data`` (no copy)."""
        views = iter(
            self.data[s.start : s.start + _nbytes(s)].view(s.dtype).view(s.shape)
            for s in self.specs
        )
        return SampleBatch.from_tensors(
            views, self.uih, self.candidates, self.content, self.has_dense
        )


def _nbytes(spec: Spec) -> int:
    n = spec.dtype.itemsize
    for d in spec.shape:
        n *= d
    return n


def pack(batch: SampleBatch) -> PackedBatch:
    """``batch``'s tensors copied into one buffer on its device (any dtypes and shapes)."""
    tensors = list(batch.tensors())
    specs, end = [], 0
    for t in tensors:
        start = -(-end // ALIGN) * ALIGN
        specs.append(Spec(t.dtype, tuple(t.shape), start))
        end = start + t.numel() * t.element_size()
    data = torch.empty(end, dtype=torch.uint8, device=batch.device)
    for t, s in zip(tensors, specs, strict=True):
        if t.numel():
            data[s.start : s.start + _nbytes(s)].view(t.dtype).copy_(t.reshape(-1))
    return PackedBatch(
        data,
        tuple(specs),
        tuple(batch.uih.features),
        tuple(batch.candidates.features),
        tuple(batch.content.features),
        batch.dense is not None,
    )
