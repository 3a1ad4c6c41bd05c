"""Data-loading stage: worker processes build batches, a thread copies them to the device.

Building a long-UIH batch is Python and numpy work of about a step's length
(h200-21k), so it runs in ``torch.utils.data.DataLoader`` worker processes:
it never competes with the trainer's launch thread (or the balancer's helper
thread) for the GIL. On GPUs each batch travels packed into one buffer
(`freescale.jagged.packed`: one shared-memory descriptor, one pinned buffer
and one copy instead of one of each per tensor). The DataLoader pins the
batches; a small thread of the trainer then issues each host-to-device copy
on a dedicated copy stream and queues the batch with an event that the
consumer's stream waits on, so the copy overlaps the previous step's
compute. ``workers=0`` builds batches in that thread instead (the CPU demo:
no process start-up).

Batches stay in step order (the DataLoader returns them in order), ``depth``
batches ahead of the trainer per worker (the paper budgets one extra batch).
A worker also counts each batch's FLOPs with the model's ``flops(batch)`` (the
model reaches the workers by fork, like the source; they never touch its
parameters), so the step never reads a size back for MFU.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from freescale.balance.world import NUM_FEATURES, batch_features
from freescale.jagged.batch import SampleBatch
from freescale.jagged.packed import PackedBatch, pack
from freescale.observe.flops import count, model_flops
from freescale.pipeline.inputs import DATA_ERROR

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
    problem: list[int] | None = None  # first input problem (`freescale.pipeline.inputs`)
    # summed cost features (samples, ΣL, ΣL², candidates, content), logged per rank so
    # that compute models can be fitted and checked from the step JSON lines
    features: tuple[float, ...] = (0.0,) * NUM_FEATURES
    # the source could not build the batch (a bad row of streamed data): its one line,
    # agreed by every rank like an input problem (`freescale.pipeline.inputs`)
    error: str = ""
    flops: float | None = None  # the model's FLOPs of a training step on it (None: not counted)

    @classmethod
    def of(
        cls, batch: SampleBatch, with_lengths: Any = None, validate: Any = None, flops: Any = None
    ) -> BatchInfo:
        problem = validate(batch) if validate is not None else None
        if problem is not None:  # sizes of a malformed batch are meaningless; all ranks raise
            return cls(0, 0, 0, 0, 0.0, batch.batch_size, problem=problem)
        uih, cand = batch.uih_lengths(), batch.num_candidates()
        return cls(
            max_uih=int(uih.max()) if uih.numel() else 0,
            max_candidates=int(cand.max()) if cand.numel() else 0,
            uih_tokens=int(uih.sum()),
            candidates=batch.num_candidates_total,
            positives=float(batch.labels.sum()),
            samples=batch.batch_size,
            lengths=None if with_lengths is None else with_lengths(batch),
            features=tuple(batch_features(batch).tolist()),
            flops=count(flops, batch),
        )


class StepBatches(Dataset):
    """Item ``k``: this rank's batches of steps ``steps[k*group : (k+1)*group]``,
    each with its `BatchInfo`.

    A pure function of ``k`` (sources are deterministic), so any worker may
    build any item. ``group`` > 1 gives a worker runs of consecutive steps: a
    streamed source reads (decodes) a window once for the run instead of once
    per worker whose steps touch it (`steps_per_read`).
    """

    def __init__(
        self,
        source: Any,
        rank: int,
        world_size: int,
        batch_size: int,
        steps: range,
        host_lengths: Any = None,
        validate: Any = None,
        packed: bool = False,
        flops: Any = None,
        group: int = 1,
    ) -> None:
        self.source, self.rank, self.world_size = source, rank, world_size
        self.batch_size, self.steps = batch_size, steps
        self.host_lengths, self.validate = host_lengths, validate
        self.packed, self.flops, self.group = packed, flops, group

    def __len__(self) -> int:
        return -(-len(self.steps) // self.group)

    def __getitem__(self, k: int) -> list[tuple[SampleBatch | PackedBatch | None, BatchInfo]]:
        steps = self.steps[k * self.group : (k + 1) * self.group]
        return [self.one(step) for step in steps]

    def one(self, step: int) -> tuple[SampleBatch | PackedBatch | None, BatchInfo]:
        try:
            batch = self.source.batch(step, self.rank, self.world_size, self.batch_size)
        except ValueError as e:  # the data's own one-line error: no batch, every rank raises
            return None, BatchInfo(
                0, 0, 0, 0, 0.0, 0, problem=[DATA_ERROR, 0, 0, 0, 0, 0], error=str(e)
            )
        info = BatchInfo.of(batch, self.host_lengths, self.validate, self.flops)
        return (pack(batch) if self.packed else batch), info


def _worker_init(_: int) -> None:
    # One intra-op thread per worker: several workers must not oversubscribe
    # the cores that the trainer's own threads need.
    torch.set_num_threads(1)


def steps_per_read(source: Any, batch_size: int, workers: int) -> int:
    """Consecutive steps one worker builds (`StepBatches` ``group``): the source's
    ``steps_per_read(batch_size)`` when it streams and there are several workers."""
    read = getattr(source, "steps_per_read", None)
    return max(1, int(read(batch_size))) if read is not None and workers > 1 else 1


def default_workers(device: torch.device) -> int:
    """Worker processes per rank when the config says ``-1`` (auto)."""
    if device.type != "cuda":
        return 0  # CPU ranks: the ranks themselves use the cores
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(4, (os.cpu_count() or 2) // max(1, local) - 1))


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
        workers: int = 0,
        delay_ms: float = 0.0,
        validate: Any = None,
        packed: bool | None = None,
        model: Any = None,
    ) -> None:
        """``model``: whose ``flops(batch)`` counts each batch's FLOPs (`BatchInfo.flops`)."""
        self.device = device
        cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if cuda else None
        # Injected delay (`freescale.pipeline.faults`): the copy thread hands
        # out at most one batch per ``delay_ms``, whatever the worker count.
        self.delay_s = delay_ms / 1000.0
        # Packed (default on GPUs): one descriptor, pinned buffer and copy per batch.
        packed = cuda if packed is None else packed
        group = steps_per_read(source, batch_size, workers)
        data = StepBatches(
            source, rank, world_size, batch_size, steps, host_lengths, validate, packed,
            model_flops(model), group,
        )  # fmt: skip
        loader = DataLoader(
            data,
            batch_size=None,  # items are lists of whole batches already
            num_workers=workers,
            pin_memory=cuda,
            prefetch_factor=max(1, depth // group) if workers else None,
            worker_init_fn=_worker_init if workers else None,
            # fork: the source is inherited, not pickled; workers never touch CUDA.
            multiprocessing_context="fork" if workers else None,
        )
        self._batches = iter(loader)  # starts the workers here, on the caller's thread
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for batch, info in (one for item in self._batches for one in item):
                if self._stop.is_set():
                    break
                if self.delay_s:
                    time.sleep(self.delay_s)
                event = None
                if self.copy_stream is not None and batch is not None:
                    with torch.cuda.stream(self.copy_stream):
                        batch = batch.to(self.device, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(self.copy_stream)
                if isinstance(batch, PackedBatch):
                    batch = batch.unpack()
                self._put((batch, info, event))
        except BaseException as e:  # surfaced in get(), on the trainer's thread
            self._error = e
        finally:
            self._put(_DONE)

    def _put(self, item: Any) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

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

    def close(self) -> None:
        """Stop the copy thread and the worker processes."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._batches = None  # the DataLoader iterator shuts its workers down
