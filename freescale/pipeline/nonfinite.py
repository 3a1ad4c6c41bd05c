"""Non-finite steps: skipped on every rank, counted, and fatal when they persist.

What the trainer sees of a step (all decided on the device, read one step
later with the metrics):

- the tables' flag (`freescale.embedding.nonfinite`): any rank's loss or any
  gradient reaching the tables was not finite; agreed across ranks inside
  backward, before any row changed;
- the dense flag: the all-reduced dense gradients (identical on every rank)
  are not finite. Fused Adam skips on the OR of both (``found_inf``).

A non-finite that shows *only* in a dense weight gradient (finite loss and
finite embedding gradients everywhere, e.g. an overflow in one weight's
product) is found after the tables were updated: the dense step is skipped,
the tables' is not. That step is reported as "partial" and always fails the
run under ``nonfinite=raise``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from freescale.embedding.nonfinite import NonFiniteGuard, nonfinite_in


class NonFiniteError(FloatingPointError):
    """Training stopped on non-finite steps (a one-line message, like input errors)."""


def skip_flags(
    guard: NonFiniteGuard, params: Iterable[nn.Parameter], device: torch.device
) -> Tensor:
    """``[skipped, partial, seen on this rank]`` (bool, on ``device``) after backward."""
    grads = [p.grad for p in params if p.grad is not None]
    dense = nonfinite_in(grads) if grads else torch.zeros((), dtype=torch.bool, device=device)
    tables, here = guard.step_flag(), guard.seen_here()
    tables = dense.new_zeros(()) if tables is None else tables
    here = dense.new_zeros(()) if here is None else here
    return torch.stack([tables | dense, dense > tables, here])  # > : dense and not tables


class NonFiniteCount:
    """Skipped steps of the run; raises per the ``nonfinite`` policy."""

    def __init__(self, policy: str, max_skips: int) -> None:
        self.policy, self.max_skips = policy, max_skips
        self.skipped = 0  # steps skipped in this run
        self.in_a_row = 0

    def count(self, step: int, skipped: bool, partial: bool, ranks: list[int]) -> None:
        """Step ``step`` was (not) skipped; ``ranks``: where a non-finite was first seen."""
        if not skipped:
            self.in_a_row = 0
            return
        self.skipped += 1
        self.in_a_row += 1
        where = f"on rank {', '.join(map(str, ranks))}" if ranks else "in the dense gradients"
        if partial and self.policy == "raise":
            raise NonFiniteError(
                f"step {step}: a dense weight gradient is not finite while the loss and "
                "embedding gradients are (the tables were already updated); the dense "
                "update was skipped. Lower dense_lr, or set nonfinite=skip to go on"
            )
        if self.policy == "raise" and self.in_a_row > self.max_skips:
            raise NonFiniteError(
                f"step {step}: non-finite loss or gradients (first seen {where}) in "
                f"{self.in_a_row} consecutive steps, each skipped on every rank "
                f"(nonfinite_max_skips={self.max_skips}); lower dense_lr/emb_lr, check "
                "the data, or set nonfinite=skip"
            )
