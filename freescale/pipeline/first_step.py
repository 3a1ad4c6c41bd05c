"""The model contract checked on the first step, before anything is updated.

The forward's output is checked right after the first forward, before the loss
and backward run; a custom loss's result right after it is computed. Every
rank learns every rank's first problem (one gloo all-gather per check, on the
first step only), so every rank raises the same one-line ValueError.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

from freescale.jagged.batch import SampleBatch


def output_problem(name: str, logits: Any, batch: SampleBatch) -> str | None:
    """What is wrong with ``logits`` as ``name``'s forward output on ``batch`` (None: fine)."""
    want = tuple(batch.labels.shape)
    if not isinstance(logits, Tensor):
        return (f"{name}.forward returned {type(logits).__name__}, not a Tensor: return one "
                f"float logit per candidate, shape {list(want)} like batch.labels")  # fmt: skip
    if tuple(logits.shape) != want:
        return (f"{name}.forward returned shape {list(logits.shape)} for "
                f"{want[0]} candidates: return one logit per candidate, shape {list(want)} "
                f"like batch.labels (not one per sample: batch.candidates.offsets maps "
                f"them)")  # fmt: skip
    if not logits.is_floating_point():
        return (f"{name}.forward returned {logits.dtype} logits: return float logits "
                f"(no rounding or argmax), one per candidate")  # fmt: skip
    if not bool(logits.isfinite().all()):  # one host sync, on the first step only
        return (f"{name}.forward returned non-finite logits (NaN or inf) on the first step, "
                f"before any update: check the model's initialization and its math")  # fmt: skip
    return None


def loss_problem(name: str, result: Any) -> str | None:
    """What is wrong with ``result`` as ``name``'s ``loss(...)`` return (None: fine)."""
    want = "return (loss, loss_sum), each one float value (a sum over candidates / normalizer)"
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return f"{name}.loss returned {type(result).__name__}, not a pair: {want}"
    for what, value in zip(("loss", "loss_sum"), result, strict=True):
        if not isinstance(value, Tensor) or value.numel() != 1 or not value.is_floating_point():
            got = list(value.shape) if isinstance(value, Tensor) else type(value).__name__
            return f"{name}.loss returned a {what} of shape {got}, not one value: {want}"
    return None


class FirstStepCheck:
    """The first step's checks of ``model``'s output and loss, agreed over ``group``."""

    def __init__(self, model: Any, group: Any, world: int) -> None:
        self.name, self.group, self.world = type(model).__name__, group, world
        self.done: set[str] = set()

    def output(self, logits: Any, batch: SampleBatch) -> None:
        if "output" not in self.done:
            self._agree("output", output_problem(self.name, logits, batch))

    def loss(self, result: Any) -> Any:
        """``result`` (the model's ``loss(...)``), checked on the first step."""
        if "loss" not in self.done:
            self._agree("loss", loss_problem(self.name, result))
        return result

    def _agree(self, what: str, problem: str | None) -> None:
        self.done.add(what)
        problems = [problem]
        if self.world > 1:  # every rank takes part, problem or not
            problems = [None] * self.world
            dist.all_gather_object(problems, problem, group=self.group)
        for rank, found in enumerate(problems):
            if found is not None:
                raise ValueError(f"the model's contract (rank {rank}): {found}")
