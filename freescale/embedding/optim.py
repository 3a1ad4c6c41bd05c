"""Sparse, row-wise optimizers applied on the owner of each row.

A config (`SGD`, `RowwiseAdagrad`, `Adam`) is a frozen dataclass: it is part
of the grouping key of a sharded store, so tables with different optimizers
never share one. ``update`` receives the *unique* touched local rows (sorted)
and their summed fp32 gradient; rows that were not touched do not change,
and neither does their optimizer state (so Adam is "lazy": a row's moments
decay only when the row is read by some rank in that step).

The step of a table counts its backward passes (1 for the first update). It
drives Adam's bias correction and the learning-rate hook ``lr_schedule(step)``
(when given, it replaces ``lr``). Optimizer state is fp32 whatever the table
dtype; the new weights are rounded to the table dtype once per update.

Weight decay (``weight_decay > 0``) follows FBGEMM's definitions, and like
everything else here it touches only the rows updated in the step: "l2" adds
``weight_decay * w`` to the row's gradient before the optimizer sees it;
"decoupled" subtracts ``lr * weight_decay * w`` (the old row) from the
optimizer's result. SGD has one (the two agree), row-wise Adagrad both, Adam
the decoupled one (FBGEMM's Adam, like AdamW). ``weight_decay = 0`` computes
exactly what it did without the option.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LrSchedule = Callable[[int], float]
# ``lr`` and the bias corrections are per-row columns [U, 1] when the tables
# of a store are at different steps, plain floats otherwise.
Scalar = float | Tensor
DecayMode = Literal["l2", "decoupled"]


def _check_decay(weight_decay: float, mode: str, modes: tuple[str, ...]) -> None:
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise ValueError(f"weight_decay must be finite and >= 0, got {weight_decay}")
    if mode not in modes:
        raise ValueError(f"weight_decay_mode must be one of {modes}, got {mode!r}")


def _decay_spec(weight_decay: float, mode: str) -> dict:
    """The kernel's decay arguments: none at all when there is no decay."""
    return {"weight_decay": weight_decay, "decay_mode": mode} if weight_decay else {}


def _check_lr(lr: float, schedule: LrSchedule | None) -> None:
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be finite and >= 0, got {lr}")
    if schedule is not None and not callable(schedule):
        raise ValueError("lr_schedule must be a callable step -> lr")


class _Base:
    lr: float
    lr_schedule: LrSchedule | None

    def lr_at(self, step: int) -> float:
        """Learning rate of the update number ``step`` (1-based)."""
        if self.lr_schedule is None:
            return self.lr
        lr = float(self.lr_schedule(step))
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"lr_schedule({step}) returned {lr}; it must be finite and >= 0")
        return lr

    def bias_corrections(self, step: int) -> tuple[float, float]:
        return 1.0, 1.0

    def state_specs(self, dim: int) -> dict[str, tuple[tuple[int, ...], float]]:
        """Per-row optimizer state: name -> (shape after the row dim, initial value)."""
        return {}


@dataclass(frozen=True)
class SGD(_Base):
    """w <- w - lr * (g + weight_decay * w)."""

    lr: float = 0.01
    lr_schedule: LrSchedule | None = None
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_lr(self.lr, self.lr_schedule)
        _check_decay(self.weight_decay, "l2", ("l2",))

    def update(
        self, w: Tensor, state: dict[str, Tensor], g: Tensor, lr: Scalar, bc: tuple[Scalar, Scalar]
    ) -> Tensor:
        if self.weight_decay:
            g = g + self.weight_decay * w
        return w - lr * g

    def kernel_spec(self) -> dict:
        return {"kind": "sgd", **_decay_spec(self.weight_decay, "l2")}


@dataclass(frozen=True)
class RowwiseAdagrad(_Base):
    """One accumulator per row: s <- s + mean(g^2); w <- w - lr * g / (sqrt(s) + eps).

    ``weight_decay_mode`` "l2": ``g + weight_decay * w`` replaces ``g`` (in ``s``
    too); "decoupled": ``lr * weight_decay * w`` is subtracted as well."""

    lr: float = 0.01
    eps: float = 1e-8
    initial_accumulator: float = 0.0
    lr_schedule: LrSchedule | None = None
    weight_decay: float = 0.0
    weight_decay_mode: DecayMode = "l2"

    def __post_init__(self) -> None:
        _check_lr(self.lr, self.lr_schedule)
        if not self.eps > 0 or self.initial_accumulator < 0:
            raise ValueError("RowwiseAdagrad needs eps > 0 and initial_accumulator >= 0")
        _check_decay(self.weight_decay, self.weight_decay_mode, ("l2", "decoupled"))

    def state_specs(self, dim: int) -> dict[str, tuple[tuple[int, ...], float]]:
        return {"sum_sq": ((), self.initial_accumulator)}

    def update(
        self, w: Tensor, state: dict[str, Tensor], g: Tensor, lr: Scalar, bc: tuple[Scalar, Scalar]
    ) -> Tensor:
        decay, mode = self.weight_decay, self.weight_decay_mode
        if decay and mode == "l2":
            g = g + decay * w
        s = state["sum_sq"] + (g * g).mean(dim=1)
        state["sum_sq"] = s
        new = w - lr * g / (s.sqrt().unsqueeze(1) + self.eps)
        if decay and mode == "decoupled":
            new = new - lr * decay * w
        return new

    def kernel_spec(self) -> dict:
        decay = _decay_spec(self.weight_decay, self.weight_decay_mode)
        return {"kind": "rowwise_adagrad", "eps": self.eps, **decay}


@dataclass(frozen=True)
class Adam(_Base):
    """Per-element moments stored per row; bias correction from the table's step.
    Weight decay is decoupled: ``lr * weight_decay * w`` is subtracted too."""

    lr: float = 0.001
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    lr_schedule: LrSchedule | None = None
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_lr(self.lr, self.lr_schedule)
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1 and self.eps > 0):
            raise ValueError("Adam needs 0 <= beta1, beta2 < 1 and eps > 0")
        _check_decay(self.weight_decay, "decoupled", ("decoupled",))

    def bias_corrections(self, step: int) -> tuple[float, float]:
        return 1.0 - self.beta1**step, 1.0 - self.beta2**step

    def state_specs(self, dim: int) -> dict[str, tuple[tuple[int, ...], float]]:
        return {"exp_avg": ((dim,), 0.0), "exp_avg_sq": ((dim,), 0.0)}

    def update(
        self, w: Tensor, state: dict[str, Tensor], g: Tensor, lr: Scalar, bc: tuple[Scalar, Scalar]
    ) -> Tensor:
        m = self.beta1 * state["exp_avg"] + (1.0 - self.beta1) * g
        v = self.beta2 * state["exp_avg_sq"] + (1.0 - self.beta2) * (g * g)
        state["exp_avg"], state["exp_avg_sq"] = m, v
        denom = (v / bc[1]).sqrt() + self.eps
        new = w - lr * (m / bc[0]) / denom
        if self.weight_decay:
            new = new - lr * self.weight_decay * w
        return new

    def kernel_spec(self) -> dict:
        decay = _decay_spec(self.weight_decay, "decoupled")
        return {"kind": "adam", "eps": self.eps, "betas": (self.beta1, self.beta2), **decay}


OptimizerConfig = SGD | RowwiseAdagrad | Adam
# The names a config chooses a table optimizer by (``embeddings.optimizer``).
OPTIMIZERS: dict[str, type[OptimizerConfig]] = {
    "sgd": SGD,
    "adagrad": RowwiseAdagrad,
    "adam": Adam,
}


def apply_rows(
    opt: OptimizerConfig,
    weight: Tensor,
    state: dict[str, Tensor],
    rows: Tensor,
    grad: Tensor,
    lr: Scalar,
    bc: tuple[Scalar, Scalar],
    skip: Tensor | None = None,
) -> None:
    """Update ``weight[rows]`` and ``state[*][rows]`` in place (``rows`` unique).

    Reads the touched rows, computes in fp32, writes them back; duplicate-free
    rows make the scatter deterministic. When the 0-dim device flag ``skip`` is
    true the old values are written back (decided on the device, no host read).
    """
    if rows.numel() == 0:
        return
    w = weight.index_select(0, rows).float()
    old_state = {name: t.index_select(0, rows) for name, t in state.items()}
    rows_state = dict(old_state)  # `update` replaces its entries with the new state
    new_w = opt.update(w, rows_state, grad, lr, bc)
    if skip is not None:
        new_w = torch.where(skip, w, new_w)
        rows_state = {k: torch.where(skip, old_state[k], v) for k, v in rows_state.items()}
    # index_put_ (not index_copy_) keeps torch's deterministic mode usable on CUDA.
    weight.index_put_((rows,), new_w.to(weight.dtype))
    for name, t in state.items():
        t.index_put_((rows,), rows_state[name])


def make_state(
    opt: OptimizerConfig, rows: int, dim: int, device: torch.device
) -> dict[str, Tensor]:
    """Fresh fp32 optimizer state for ``rows`` local rows."""
    return {
        name: torch.full((rows, *shape), init, dtype=torch.float32, device=device)
        for name, (shape, init) in opt.state_specs(dim).items()
    }
