"""Injected delays: known extra time on chosen ranks, to check the metrics.

``delay_compute_ms`` adds work to every step's compute (inside the step,
after forward): a host sleep on CPU ranks, a GPU spin of that length on the
compute stream on CUDA (the host does not wait). ``delay_loader_ms`` makes
the loader hand out at most one batch per that many ms. ``delay_ranks`` names
the ranks affected (all when empty). A metric that blames the right cause
must show the first as straggler time and the second as data wait.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from freescale.config.values import parse_ranks


def applies(ranks_text: str, rank: int) -> bool:
    ranks = parse_ranks(ranks_text)
    return ranks is None or rank in ranks


class ComputeDelay:
    """``delay()`` adds ``ms`` of compute to the current step of this rank."""

    def __init__(self, ms: float, device: torch.device) -> None:
        self.ms, self.cuda = ms, device.type == "cuda"
        self.cycles = 0
        if ms > 0 and self.cuda:
            self.cycles = int(ms * _cycles_per_ms())

    def __call__(self) -> None:
        if self.ms <= 0:
            return
        if self.cuda:
            torch.cuda._sleep(self.cycles)
        else:
            time.sleep(self.ms / 1000.0)


def _cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of ``torch.cuda._sleep``, measured once."""
    n = 20_000_000
    torch.cuda._sleep(n)  # warm-up (clocks ramp up)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return n / start.elapsed_time(end)


class LossFault:
    """``faults.nan_steps`` / ``nan_ranks``: this rank's loss is made NaN at
    those steps (it checks the non-finite guard end to end)."""

    def __init__(self, steps_text: str, ranks_text: str, rank: int) -> None:
        steps = parse_ranks(steps_text) or set()
        self.steps = steps if applies(ranks_text, rank) else set()

    def __call__(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if step in self.steps else loss


class Faults:
    """The ``faults`` section on this rank: ``delay_compute()``, ``delay_loader_ms``
    and ``loss(step, loss)`` (NaN at ``nan_steps``); the non-finite policy is
    `freescale.pipeline.dense`'s."""

    def __init__(self, section: Any, rank: int, device: torch.device) -> None:
        delayed = applies(section.delay_ranks, rank)
        self.delay_compute = ComputeDelay(section.delay_compute_ms if delayed else 0.0, device)
        self.delay_loader_ms = section.delay_loader_ms if delayed else 0.0
        self.loss = LossFault(section.nan_steps, section.nan_ranks, rank)
