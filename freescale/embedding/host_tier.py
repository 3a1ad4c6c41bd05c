"""The host tier: a shard's rows and optimizer state in host memory.

A table placed on the host (``TableConfig(placement="host")``) keeps its shard
and its optimizer state in host memory, pinned when the compute device is a
GPU. Pinned memory is mapped into the GPU's address space (UVA), so GPU
kernels read and write its rows over PCIe in place: the lookup's gather
(`freescale.kernels.host_rows`) and the optimizer's fused update
(`freescale.kernels.triton_update`, whose pointers may be host ones) move only
the rows a step touches, never a whole shard. On the CPU the same calls run
their torch twins, so a CPU run exercises the tier's whole schedule.

**Prefetch (staging).** A mode that knows the next step's shard-major slots
early (`SparseDataDist`, at ``prefetch_ids``) calls `HostTier.stage`: the
rows are gathered on a side stream into a step-sized device buffer while the
current step computes, except those the current step read: its update (still
to come) will write them, so they are deferred (`Staged.pending`). Every
update calls `HostTier.refresh`, which reads, behind the update, the deferred
rows and the staged rows it wrote (a mask: no host read), so each row crosses
PCIe once per step, as in `sync`. The invariant: *a staged buffer, when its
lookup takes it, equals a fresh gather of its slots*. It is kept by the
tier's own writes (updates refresh it, loads drop it, a lookup with rows
still deferred reads them first), so it holds whatever the schedule.
In `Prioritized` mode nothing is staged: its prefetch already looks the next
step's rows up ahead, and only the collision rows are read after the update,
as for device tables.

**Traffic.** The tier counts the bytes it moves between host and device
(`HostTier.take_bytes`): gathers (rows), refreshes (rows), updates (rows and
optimizer state, read and written back).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from freescale.jagged.ops import record_event, side_stream
from freescale.kernels.host_rows import gather_host_rows, refresh_host_rows


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialized host tensor that kernels on ``device`` can read: pinned
    (mapped into the GPU's address space) when ``device`` is a GPU."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


@dataclass
class Staged:
    """The next lookup's rows, gathered ahead into a device buffer."""

    slots: Tensor  # the shard-major slots the lookup will pass (the same tensor)
    rows: Tensor  # [len(slots), dim] on the device
    ready: Any = None  # CUDA event after the gather (and any refresh); None on CPU
    # rows not gathered yet (bool per slot): an earlier lookup's update will write them
    pending: Tensor | None = None


class HostTier:
    """Reads and writes of one store's host-resident rows, and the staged buffer.

    ``row_bytes``: bytes of one row plus its optimizer state (what an update
    moves each way)."""

    def __init__(self, device: torch.device, row_bytes: int) -> None:
        self.device = device
        self.row_bytes = row_bytes
        self.staged: Staged | None = None
        # the slots of the last lookup, until an update writes them (`stage` defers them)
        self._unwritten: Tensor | None = None
        self._bytes = 0  # known on the host: gathers
        self._device_bytes: Tensor | None = None  # refreshes and updates (device counts)

    # ---- reads ---------------------------------------------------------------
    def gather(self, weight: Tensor, slots: Tensor) -> Tensor:
        """``weight[slots]`` on the device: the staged buffer when it holds them."""
        staged = self.staged
        if staged is not None and staged.slots is slots:
            if staged.pending is not None:  # no update came: read the deferred rows now
                self.refresh(weight, slots[:0])
            self.staged, self._unwritten = None, slots
            if staged.ready is not None:
                torch.cuda.current_stream(self.device).wait_event(staged.ready)
                staged.rows.record_stream(torch.cuda.current_stream(self.device))
            return staged.rows
        self._bytes += slots.shape[0] * weight.shape[1] * weight.element_size()
        self._unwritten = slots
        return gather_host_rows(weight, slots, self.device)

    def stage(self, weight: Tensor, slots: Tensor) -> None:
        """Start gathering ``weight[slots]`` for the next lookup, off the compute stream.

        Rows the last lookup read are deferred: its update (still to come) will
        write them, and `refresh` reads them after it; reading them now too
        would move them twice."""
        pending = torch.isin(slots, self._unwritten) if self._unwritten is not None else None
        # After the compute stream's work so far (the slots'); at sdd's
        # ``prefetch_ids`` that is the current forward: the gather overlaps backward.
        with self._side() as side:
            if side is not None:  # made on the compute stream, read here
                slots.record_stream(side)
            if pending is None:
                self._bytes += slots.shape[0] * weight.shape[1] * weight.element_size()
                rows = gather_host_rows(weight, slots, self.device)
            else:
                if side is not None:
                    pending.record_stream(side)
                rows = torch.empty((slots.shape[0], weight.shape[1]), dtype=weight.dtype,
                                   device=self.device)  # fmt: skip
                ahead = ~pending
                self._count(ahead.sum() * (weight.shape[1] * weight.element_size()))
                refresh_host_rows(weight, slots, ahead, rows)
            ready = record_event() if side is not None else None
        self.staged = Staged(slots, rows, ready, pending)

    def refresh(self, weight: Tensor, written: Tensor, after: Any = None) -> None:
        """The slots ``written`` changed on the host (by an update queued on the
        current stream, or before the event ``after``): re-read, behind it,
        those of them the staged buffer holds."""
        self._unwritten = None
        staged = self.staged
        if staged is None:
            return
        mask = torch.isin(staged.slots, written)
        if staged.pending is not None:  # and the rows deferred for this update
            mask, staged.pending = mask | staged.pending, None
        self._count(mask.sum() * (weight.shape[1] * weight.element_size()))
        with self._side() as side:
            if side is not None and after is not None:
                side.wait_event(after)
            refresh_host_rows(weight, staged.slots, mask, staged.rows)
            if side is not None:
                staged.ready = record_event()

    def drop(self) -> None:
        """Forget the staged buffer (the host rows were overwritten wholesale)."""
        self.staged, self._unwritten = None, None

    # ---- writes --------------------------------------------------------------
    def count_update(self, slots: Tensor) -> None:
        """An update of the distinct rows of ``slots``: read and written back."""
        if slots.numel() == 0:
            return
        ordered = slots.sort().values
        distinct = (ordered[1:] != ordered[:-1]).sum() + 1
        self._count(distinct * (2 * self.row_bytes))

    # ---- traffic -------------------------------------------------------------
    def take_bytes(self) -> Tensor:
        """Bytes moved between host and device since the last call: a 0-dim
        int64 device tensor (not read here; a fill kernel carries the host count)."""
        total = torch.full((), self._bytes, dtype=torch.int64, device=self.device)
        if self._device_bytes is not None:
            total = total + self._device_bytes
        self._bytes, self._device_bytes = 0, None
        return total

    def _count(self, nbytes: Tensor) -> None:
        nbytes = nbytes.to(torch.int64)
        self._device_bytes = nbytes if self._device_bytes is None else self._device_bytes + nbytes

    @contextlib.contextmanager
    def _side(self) -> Iterator[torch.cuda.Stream | None]:
        """The tier's side stream on a GPU, after the work queued so far on the
        current stream (its inputs); nothing on the CPU."""
        if self.device.type != "cuda":
            yield None
            return
        side = side_stream("host tier", self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            yield side


def available_host_bytes() -> int | None:
    """MemAvailable of this host (Linux), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_host_memory(needed: int, ranks_on_host: int, available: int | None = None) -> None:
    """One line (ValueError) when this host cannot hold its ranks' host tiers."""
    available = available_host_bytes() if available is None else available
    total = needed * ranks_on_host
    if available is not None and total > available:
        raise ValueError(
            f"host-tier tables need {total / 2**30:.2f} GiB of host memory on this host "
            f"({ranks_on_host} rank(s) x {needed / 2**30:.2f} GiB), "
            f"{available / 2**30:.2f} GiB available: place fewer tables on the host"
        )


def ranks_on_host(world_size: int) -> int:
    """Ranks sharing this host's memory: torchrun's LOCAL_WORLD_SIZE, else all."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
