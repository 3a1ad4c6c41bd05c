"""Learning-rate warm-up and decay, one closed form for the dense and the embedding optimizers.

Update number ``s`` (1-based) of a run of ``T`` steps, base rate ``lr``,
``W`` warm-up updates::

    s <= W:  lr * s / W                                   (linear warm-up)
    s >  W:  t = (s - W - 1) / (T - W)                    (0 right after warm-up)
             none: lr;  linear: lr * (1 - t);  cosine: lr * (1 + cos(pi * t)) / 2

The rate depends on ``s`` alone, so a resumed run, every mode and every
world size use the same rates. The dense optimizer counts ``s`` as the
trainer's step + 1; a sharded table as its own updates (`embedding.optim`:
a step skipped for a non-finite value is not one of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("none", "linear", "cosine")


@dataclass(frozen=True)
class LrSchedule:
    """``schedule(s)``: the learning rate of update ``s`` (see the module docstring)."""

    lr: float
    warmup: int
    decay: str
    total: int

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ValueError(f"lr_decay must be one of {', '.join(DECAYS)}; got {self.decay!r}")
        if not 0 <= self.warmup < self.total:
            raise ValueError(
                f"lr_warmup ({self.warmup}) must be >= 0 and < the run's steps ({self.total})"
            )

    def __call__(self, step: int) -> float:
        if step <= self.warmup:
            return self.lr * step / self.warmup
        t = min(1.0, (step - self.warmup - 1) / (self.total - self.warmup))
        if self.decay == "linear":
            return self.lr * (1.0 - t)
        if self.decay == "cosine":
            return self.lr * (1.0 + math.cos(math.pi * t)) / 2.0
        return self.lr


def lr_schedule(lr: float, warmup: int, decay: str, total: int) -> LrSchedule | None:
    """The schedule of a section's keys; None when there is none (a constant ``lr``)."""
    if not warmup and decay == "none":
        return None
    return LrSchedule(lr, warmup, decay, total)
