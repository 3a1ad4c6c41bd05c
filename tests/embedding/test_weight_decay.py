"""Weight decay of the row-wise optimizers against independent references:
``torch.optim.SGD`` (L2) and ``torch.optim.AdamW`` (decoupled) on rows updated
every step, the definitions for row-wise Adagrad; untouched rows do not decay."""

import pytest
import torch

from freescale.embedding import SGD, Adam, RowwiseAdagrad
from freescale.embedding.optim import apply_rows, make_state
from freescale.testing.tolerance import adam_step_bound, steps_tol

pytestmark = pytest.mark.numeric

STEPS = 5


def _run_ours(opt, weight: torch.Tensor, grads: list[torch.Tensor], rows: torch.Tensor):
    w = weight.clone()
    state = make_state(opt, w.shape[0], w.shape[1], w.device)
    for step, g in enumerate(grads, start=1):
        apply_rows(opt, w, state, rows, g[rows], opt.lr, opt.bias_corrections(step))
    return w, state


def _run_torch(make, weight: torch.Tensor, grads: list[torch.Tensor]):
    p = torch.nn.Parameter(weight.clone())
    optimizer = make([p])
    for g in grads:
        p.grad = g.clone()
        optimizer.step()
    return p.detach()


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(6, 4, generator=g)
    return weight, [torch.randn(6, 4, generator=g) for _ in range(STEPS)]


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (
            SGD(lr=0.1, weight_decay=0.3),
            lambda ps: torch.optim.SGD(ps, lr=0.1, weight_decay=0.3),
        ),
        (
            Adam(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.4),
            lambda ps: torch.optim.AdamW(
                ps, lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.4
            ),
        ),
    ],
    ids=["sgd-l2", "adam-decoupled"],
)
def test_decay_of_rows_updated_every_step_matches_torch_optim(ours, theirs):
    weight, grads = _case()
    every = torch.arange(weight.shape[0])
    got, _ = _run_ours(ours, weight, grads, every)
    # The same elementwise formula in another order of operations (no sums):
    # each step's rounding is relative to the step, which is at most lr times
    # |g + decay·w| (SGD) or lr · adam_step_bound (Adam).
    if isinstance(ours, Adam):
        largest = max(adam_step_bound(ours.beta1, ours.beta2, t) for t in range(1, STEPS + 1))
    else:  # the steps of SGD with L2 decay, replayed in float64
        w, largest = weight.double(), 0.0
        for g in grads:
            step = g.double() + ours.weight_decay * w
            w, largest = w - ours.lr * step, max(largest, float(step.abs().max()))
    tol = steps_tol(torch.float32, 1, ours.lr * largest, STEPS, depth=2)
    torch.testing.assert_close(got, _run_torch(theirs, weight, grads), **tol)


@pytest.mark.parametrize("mode", ["l2", "decoupled"])
def test_rowwise_adagrad_decay_follows_its_definition(mode):
    lr, eps, decay = 0.2, 1e-6, 0.3
    weight, grads = _case(1)
    every = torch.arange(weight.shape[0])
    opt = RowwiseAdagrad(lr=lr, eps=eps, weight_decay=decay, weight_decay_mode=mode)
    got, state = _run_ours(opt, weight, grads, every)
    # The definition in FBGEMM's form: a shrink factor on the old row, then the
    # step along the raw gradient (float64).
    w, s = weight.double(), torch.zeros(weight.shape[0], dtype=torch.float64)
    for g in grads:
        g = g.double()
        seen = g + decay * w if mode == "l2" else g  # what the accumulator sees
        s = s + (seen * seen).mean(1)
        mult = lr / (s.sqrt() + eps)
        shrink = 1 - mult * decay if mode == "l2" else torch.full_like(s, 1 - lr * decay)
        w = shrink[:, None] * w - mult[:, None] * g
    # fp32 against float64: the accumulator is a sum of positive means over
    # the row's dim; the step lr·g/sqrt(s) is at most lr·sqrt(dim) and doubles
    # the relative error of g and s (`steps_tol`).
    dim = weight.shape[1]
    state_tol = steps_tol(torch.float32, dim, float(s.max()), STEPS, depth=2)
    torch.testing.assert_close(state["sum_sq"], s.float(), **state_tol)
    weight_tol = steps_tol(torch.float32, dim, lr * dim**0.5, STEPS, depth=2)
    torch.testing.assert_close(got, w.float(), **weight_tol)


@pytest.mark.parametrize(
    "opt",
    [
        SGD(lr=0.1, weight_decay=0.5),
        RowwiseAdagrad(lr=0.1, weight_decay=0.5, weight_decay_mode="decoupled"),
        Adam(lr=0.1, weight_decay=0.5),
    ],
    ids=["sgd", "adagrad", "adam"],
)
def test_rows_not_updated_do_not_decay(opt):
    """Decay is part of a row's update, as in FBGEMM: a row nobody read keeps its value."""
    weight, grads = _case(2)
    touched = torch.tensor([1, 4])
    got, _ = _run_ours(opt, weight, grads, touched)
    rest = torch.ones(weight.shape[0], dtype=torch.bool)
    rest[touched] = False
    assert torch.equal(got[rest], weight[rest])
    assert not torch.equal(got[touched], weight[touched])


def test_zero_decay_is_the_undecayed_update_bitwise():
    weight, grads = _case(3)
    rows = torch.tensor([0, 2, 5])
    pairs = [
        (SGD(lr=0.1), SGD(lr=0.1, weight_decay=0.0)),
        (RowwiseAdagrad(lr=0.1), RowwiseAdagrad(lr=0.1, weight_decay_mode="decoupled")),
        (Adam(lr=0.1), Adam(lr=0.1, weight_decay=0.0)),
    ]
    for plain, zero in pairs:
        a, sa = _run_ours(plain, weight, grads, rows)
        b, sb = _run_ours(zero, weight, grads, rows)
        assert torch.equal(a, b) and all(torch.equal(sa[k], sb[k]) for k in sa)
        assert zero.kernel_spec() == plain.kernel_spec()  # the same (undecayed) kernel


@pytest.mark.parametrize(
    "make",
    [
        lambda: SGD(weight_decay=-0.1),
        lambda: SGD(weight_decay=float("nan")),
        lambda: RowwiseAdagrad(weight_decay=0.1, weight_decay_mode="counter"),
        lambda: Adam(weight_decay=float("inf")),
    ],
)
def test_invalid_decay_raises_value_error(make):
    with pytest.raises(ValueError, match="weight_decay"):
        make()
