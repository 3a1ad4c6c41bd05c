"""Metrics of every step, read one step late, from the ``output`` section.

A step leaves a `StepRecord` (its values still on the device, copied without
waiting); the next step's `StepMetrics.finish` reads it, gathers every rank's
`RankStep` over gloo, writes the metrics line (and TensorBoard's scalars)
and prints progress.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from freescale.config import OutputSection, RunSection
from freescale.jagged.ops import copy_to_host, wait_for_copy
from freescale.observe.board import ScalarBoard
from freescale.observe.flops import peak_tflops
from freescale.observe.metrics import (
    NONFINITE,
    STOP,
    JsonLines,
    RankStep,
    RunSummary,
    gather_step,
    summarize_step,
)
from freescale.observe.timing import (
    COLLISION_PART,
    HOST_TIER_PART,
    SectionTimer,
    exposed_by_category,
)
from freescale.pipeline.liveness import mark_stopped
from freescale.pipeline.loader import BatchInfo


def read_later(t: Tensor) -> Callable[[], list[float]]:
    """``t``'s values, copied now without waiting and read when called.

    Reading a device value at once would make the host wait for the GPU at
    the end of every step, leaving the GPU idle while the next step launches.
    """
    host, done = copy_to_host(t)
    return lambda: (wait_for_copy(done, "metrics (one step late)"), host.tolist())[1]


@dataclass
class StepRecord:
    """What one step leaves for its metrics, which are read one step later."""

    step: int
    info: BatchInfo
    # [bce sum (, the model's loss sum)], skip flags (, positives if not in info)
    values: Callable[[], list[float]]
    sections: list
    handle: Any
    compiled_frames: int = 0  # frames dynamo compiled during the step (`pipeline.compile`)
    attention_graphs: int = 0  # cuDNN attention graphs built during the step
    eval: dict[str, float] | None = None
    collision: Callable[[], list[float]] | None = None  # freescale: C^i counts, read later
    host_bytes: Callable[[], list[float]] | None = None  # host-tier traffic, read later
    dynamic: tuple[int, ...] | None = None  # dynamic tables' counts (host numbers)

    def read_later(self, collision: Tensor | None, embeddings: Any) -> None:
        """Keep the step's device counts (``collision`` may be None) and the
        tables' (host-tier traffic, dynamic tables) to read at its metrics."""
        host_bytes = embeddings.host_tier_traffic()
        self.dynamic = embeddings.dynamic_counts()
        if collision is not None:
            self.collision = read_later(collision)
        if host_bytes is not None:
            self.host_bytes = read_later(host_bytes)


class StepMetrics:
    """Every step's metrics: gathered, summarized (`summary`), written, printed.

    ``run``: the run section (mode, steps, warm-up, the peak override), ``device``
    this rank's (its peak TFLOP/s, for MFU); ``observe(compute_ms, handle)``: the
    balancer's feedback (or None); ``count(step, skipped, partial, ranks)``: the
    non-finite count."""

    def __init__(
        self,
        section: OutputSection,
        rank: int,
        run: RunSection,
        device: torch.device,
        timer: SectionTimer,
        group: Any,
        default_loss: bool,
    ) -> None:
        self.section, self.rank, self.mode, self.steps = section, rank, run.mode, run.steps
        self.timer, self.group, self.default_loss = timer, group, default_loss
        self.peak = peak_tflops(device, run.peak_tflops)
        self.summary = RunSummary(run.warmup, peak_tflops=self.peak)
        self.writer = JsonLines(section.metrics_path if rank == 0 else "")
        self.board = ScalarBoard(section.dir if rank == 0 and section.tensorboard else "")
        self.stop_agreed = False  # every rank saw a stop request in the same metrics gather

    def finish(self, rec: StepRecord, start: float, stop: bool, observe: Any, count: Any) -> None:
        """Metrics of a step, one step later (its events and values are done by then)."""
        sections = self.timer.read_ms(rec.sections)
        step_ms = sections.pop("step")  # includes the data wait
        data_ms = sections.pop("data", 0.0)
        exposed = exposed_by_category(sections)
        collision_part = sum(sections.get(name, 0.0) for name in COLLISION_PART)
        host_tier_ms = sum(sections.get(name, 0.0) for name in HOST_TIER_PART)
        info = rec.info
        values = rec.values()
        loss_sum = None if self.default_loss else values.pop(1)
        bce, skipped, partial, seen_here, *counted = values
        local = RankStep(
            step_ms=step_ms,
            # One clock: every term is an interval of the compute stream (CUDA
            # events) or, on CPU ranks, of the host's wall clock.
            compute_ms=step_ms - sum(exposed.values()) - data_ms,
            data_ms=data_ms,
            exposed=exposed,
            bce_sum=bce,
            positives=counted[0] if counted else info.positives,
            candidates=info.candidates,
            items=info.uih_tokens + info.candidates,
            samples=info.samples,
            collision_part_ms=collision_part,
            stop=float(stop),
            nonfinite=seen_here,
            features=info.features,
            loss_sum=loss_sum,
            flops=info.flops,
            compiled_frames=rec.compiled_frames,
            attention_graphs=rec.attention_graphs,
        )
        if rec.collision is not None:
            local.collision = tuple(rec.collision())  # type: ignore[assignment]
        if rec.host_bytes is not None:
            local.host_tier = (host_tier_ms, rec.host_bytes()[0])
        if rec.dynamic is not None:
            local.dynamic = tuple(float(x) for x in rec.dynamic)
        table = gather_step(local, self.group)
        if table[:, STOP].max() > 0 and not self.stop_agreed:
            self.stop_agreed = True  # every rank decides this in the same step
            mark_stopped()
        record = summarize_step(rec.step, table, self.peak)
        record["nonfinite_skipped"] = bool(skipped)
        self.summary.add(record)
        if rec.handle is not None:
            observe(record["compute_ms"], rec.handle)
        if rec.eval is not None:
            self.summary.evals.append(rec.eval)
            record["eval_ne"] = rec.eval["ne"]
            record["eval"] = {k: v for k, v in rec.eval.items() if k != "step"}
        self.writer.write(record)
        self.board.write(record)
        self._progress(rec.step, record, start)
        # The skip flags are global (agreed in backward; the dense gradients are
        # all-reduced), so every rank takes the same decision here.
        seen = [r for r, x in enumerate(table[:, NONFINITE].tolist()) if x > 0]
        count(rec.step, bool(skipped), bool(partial), seen)

    def start(self, first_step: int) -> None:
        """The run starts at ``first_step`` (> 0: resumed; later lines and events go)."""
        self.writer.start(first_step)
        self.board.start(first_step)

    def close(self) -> None:
        self.writer.close()
        self.board.close()

    def _progress(self, step: int, record: dict[str, Any], start: float) -> None:
        if self.rank != 0 or not self.section.progress:
            return
        every = max(1, self.steps // 20)
        if (step + 1) % every and step + 1 != self.steps:
            return
        ne = record.get("eval_ne", record["ne"])
        print(
            f"[{self.mode}] step {step + 1}/{self.steps}  {record['step_ms']:.0f} ms"
            f"  qps {record['qps']:.0f}  straggler {record['straggler_pct']:.1f}%  "
            f"ne {ne:.3f}  ({time.perf_counter() - start:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
