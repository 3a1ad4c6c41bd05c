"""Data-loading stage: a background thread that builds, pins and copies batches.

The thread runs ``depth`` batches ahead of the trainer (the paper budgets one
extra batch). On CUDA the host-to-device copy is issued on a dedicated copy
stream from pinned memory; the consumer's stream waits on an event, so the
copy overlaps the previous step's compute.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch

from freescale.jagged.batch import SampleBatch

_DONE = object()


@dataclass(frozen=True)
class BatchInfo:
    """Host-side sizes of a batch, computed before the copy so that the
    training step never reads them back from the device."""

    max_uih: int
    max_candidates: int
    uih_tokens: int
    candidates: int
    positives: float
    samples: int
    global_candidates: int | None = None  # known without a collective after balancing
    lengths: Any = None  # the balancer's stage-I input (`WorldLengths`), when balancing

    @classmethod
    def of(cls, batch: SampleBatch, with_lengths: Any = None) -> BatchInfo:
        uih, cand = batch.uih_lengths(), batch.num_candidates()
        return cls(
            max_uih=int(uih.max()) if uih.numel() else 0,
            max_candidates=int(cand.max()) if cand.numel() else 0,
            uih_tokens=int(uih.sum()),
            candidates=batch.num_candidates_total,
            positives=float(batch.labels.sum()),
            samples=batch.batch_size,
            lengths=None if with_lengths is None else with_lengths(batch),
        )


class Prefetcher:
    def __init__(
        self,
        source: Any,
        rank: int,
        world_size: int,
        batch_size: int,
        device: torch.device,
        steps: range,
        depth: int = 2,
        host_lengths: Any = None,
    ) -> None:
        self.host_lengths = host_lengths
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        args = (source, rank, world_size, batch_size, steps)
        self._thread = threading.Thread(target=self._run, args=args, daemon=True)
        self._thread.start()

    def _run(self, source: Any, rank: int, world: int, batch_size: int, steps: range) -> None:
        try:
            for step in steps:
                batch = source.batch(step, rank, world, batch_size)
                info = BatchInfo.of(batch, self.host_lengths)
                event = None
                if self.copy_stream is not None:
                    batch = batch.pin_memory()
                    with torch.cuda.stream(self.copy_stream):
                        batch = batch.to(self.device, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(self.copy_stream)
                self._queue.put((batch, info, event))
        except BaseException as e:  # surfaced in get(), on the trainer's thread
            self._error = e
        finally:
            self._queue.put(_DONE)

    def get(self) -> tuple[SampleBatch, BatchInfo]:
        item = self._queue.get()
        if item is _DONE:
            self._queue.put(_DONE)
            if self._error is not None:
                raise RuntimeError("data loading failed") from self._error
            raise StopIteration("no more batches")
        batch, info, event = item
        if event is not None:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(event)
            batch.record_stream(stream)
        return batch, info
