"""The row-wise optimizers written out once more, in float64, for formula tests.

Independent of `freescale.embedding.optim` (no shared code): each function
takes the old row ``w`` [D], its old state and the row's summed gradient ``g``
[D] at table step ``t`` (1-based) and returns the new row and state. The
cases use a large eps (0.5) and near-zero initial state, so that where eps
goes (outside the square root, added to it) and where the decay enters
change the result by far more than float32 rounding.
"""

from __future__ import annotations

import math

import torch

from freescale.embedding.optim import SGD, Adam, RowwiseAdagrad

EPS = 0.5

# id -> config; every optimizer and every weight decay mode.
CASES = {
    "sgd": SGD(lr=0.1),
    "sgd-scheduled": SGD(lr=0.0, lr_schedule=lambda step: 0.05 * step),
    "sgd-l2": SGD(lr=0.1, weight_decay=0.3),
    "adagrad": RowwiseAdagrad(lr=0.1, eps=EPS),
    "adagrad-init": RowwiseAdagrad(lr=0.1, eps=EPS, initial_accumulator=0.01),
    "adagrad-l2": RowwiseAdagrad(lr=0.1, eps=EPS, weight_decay=0.2),
    "adagrad-decoupled": RowwiseAdagrad(
        lr=0.1, eps=EPS, weight_decay=0.2, weight_decay_mode="decoupled"
    ),
    "adam": Adam(lr=0.1, beta1=0.8, beta2=0.95, eps=EPS),
    "adam-decoupled": Adam(lr=0.1, beta1=0.8, beta2=0.95, eps=EPS, weight_decay=0.4),
}


def initial_state(opt, dim: int) -> dict[str, torch.Tensor]:
    """One row's state before its first update (float64)."""
    if isinstance(opt, RowwiseAdagrad):
        return {"sum_sq": torch.tensor(float(opt.initial_accumulator), dtype=torch.float64)}
    if isinstance(opt, Adam):
        zeros = torch.zeros(dim, dtype=torch.float64)
        return {"exp_avg": zeros, "exp_avg_sq": zeros.clone()}
    return {}


def step(opt, w: torch.Tensor, state: dict, g: torch.Tensor, t: int):
    """(new row, new state) of one update at table step ``t``, float64."""
    w, g = w.double(), g.double()
    lr = opt.lr if opt.lr_schedule is None else opt.lr_schedule(t)
    wd = opt.weight_decay
    if isinstance(opt, SGD):
        return w - lr * (g + wd * w), {}
    if isinstance(opt, RowwiseAdagrad):
        l2 = opt.weight_decay_mode == "l2"
        seen = g + wd * w if l2 else g  # the gradient the accumulator and the step see
        s = state["sum_sq"] + (seen * seen).sum() / w.numel()
        new = w - lr * seen / (math.sqrt(s) + opt.eps)
        if not l2:
            new = new - lr * wd * w
        return new, {"sum_sq": s}
    assert isinstance(opt, Adam)
    m = opt.beta1 * state["exp_avg"] + (1 - opt.beta1) * g
    v = opt.beta2 * state["exp_avg_sq"] + (1 - opt.beta2) * g * g
    m_hat, v_hat = m / (1 - opt.beta1**t), v / (1 - opt.beta2**t)
    new = w - lr * m_hat / (v_hat.sqrt() + opt.eps) - lr * wd * w
    return new, {"exp_avg": m, "exp_avg_sq": v}


def run(opt, weight: torch.Tensor, updates: list[tuple[torch.Tensor, torch.Tensor]]):
    """Apply ``updates`` (slots with duplicates, their gradient rows), one per table
    step, to ``weight`` [rows, D]: (rows, per-row states), float64. Rows a step
    does not touch keep their values and state."""
    rows, dim = weight.shape
    w = [weight[r].double() for r in range(rows)]
    states = [initial_state(opt, dim) for _ in range(rows)]
    for t, (slots, grads) in enumerate(updates, start=1):
        for r in sorted(set(slots.tolist())):
            g = grads.double()[slots == r].sum(0)
            w[r], states[r] = step(opt, w[r], states[r], g, t)
    stacked = {name: torch.stack([s[name] for s in states]) for name in initial_state(opt, dim)}
    return torch.stack(w), stacked


def updates(seed: int, rows: int, dim: int, steps: int = 3):
    """Per step: slots with duplicates (some rows untouched), N(0, 1) gradient rows."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        slots = torch.randint(0, rows - 1, (2 * rows,), generator=g)  # the last row: never
        out.append((slots, torch.randn(slots.numel(), dim, generator=g)))
    return out
