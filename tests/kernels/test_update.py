"""Triton sparse row update vs the torch path (`sum_duplicates` + `apply_rows`)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.embedding._ops import sum_duplicates
from freescale.embedding.optim import SGD, Adam, RowwiseAdagrad, apply_rows, make_state
from freescale.testing.tolerance import abs_sum, assert_reordered_close, reduction_tol
from tests.embedding import _optim_formulas as formulas

OPTIMIZERS = [SGD(lr=0.1), RowwiseAdagrad(lr=0.05, initial_accumulator=0.1), Adam(lr=0.01)]
DECAYED = [
    SGD(lr=0.1, weight_decay=0.3),
    RowwiseAdagrad(lr=0.05, initial_accumulator=0.1, weight_decay=0.2),
    RowwiseAdagrad(lr=0.05, weight_decay=0.2, weight_decay_mode="decoupled"),
    Adam(lr=0.01, weight_decay=0.5),
]
DECAYED_IDS = ["sgd-wd", "adagrad-l2", "adagrad-decoupled", "adam-wd"]


@st.composite
def update_cases(draw):
    """Slots with duplicates; sometimes a hot slot longer than two chunks, none at all,
    frozen slots, or tables at different steps (per-row lr)."""
    n = draw(st.integers(0, 50))
    rows, dim = draw(st.integers(1, 12)), draw(st.sampled_from([1, 3, 8]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, rows, (n,), generator=g)
    if draw(st.booleans()):  # a hot row: its run spans several chunks
        slots = torch.cat([slots, torch.full((70,), rows - 1)])[torch.randperm(n + 70, generator=g)]
    grads = torch.randn(slots.numel(), dim, generator=g)
    weight = torch.randn(rows, dim, generator=g)
    frozen = torch.tensor([0]) if draw(st.booleans()) else torch.zeros(0, dtype=torch.int64)
    per_table = draw(st.booleans())
    return slots, grads, weight, frozen, per_table, draw(st.sampled_from(OPTIMIZERS + DECAYED))


def reference(opt, weight, state, slots, grads, frozen, lr, bc):
    rows, summed = sum_duplicates(slots, grads)
    keep = ~torch.isin(rows, frozen)
    apply_rows(opt, weight, state, rows[keep], summed[keep], *_cols(lr, bc, rows[keep]))


def _cols(lr, bc, rows):
    """Per-table scalars as the store's per-row columns (two tables: slots < 4, >= 4)."""
    if not isinstance(lr, torch.Tensor):
        return lr, bc
    t = (rows >= 4).long()
    return lr[t].unsqueeze(1), (bc[0][t].unsqueeze(1), bc[1][t].unsqueeze(1))


def update_tol(slots, grads, rows: int) -> tuple[dict, dict]:
    """Tolerances of the weights and of the state after one update whose
    per-row duplicate sums ran in another order (chunks and pieces vs one
    ``index_add``): the busiest row's terms and absolute sum ``S``, then the
    optimizer's formula (one more level). The weight moves by at most the
    sum's error (``lr / sqrt(state) <= 1`` for every case here: lr <= 0.2,
    state >= 0.25); the state holds ``g²`` too (``2·|g|·Δg``, ``|g| <= S``).
    """
    terms = int(torch.bincount(slots, minlength=rows).max()) if slots.numel() else 1
    size = torch.zeros(rows, grads.shape[1], dtype=torch.float64)
    size = float(size.index_add_(0, slots, grads.double().abs()).max())
    weight = reduction_tol(torch.float32, terms, size, depth=2)
    state = reduction_tol(torch.float32, terms, size * max(1.0, 2 * size), depth=2)
    return weight, state


@pytest.mark.numeric
@settings(max_examples=30, deadline=None)  # runs in both CI legs; 30 keep it under 15 s
@given(case=update_cases(), small_fan=st.booleans())
def test_triton_update_matches_reference(triton_device, case, small_fan):
    from freescale.kernels import triton_update

    fan = triton_update.fan
    if small_fan:  # hot runs then take several tiles of pieces
        triton_update.fan = lambda block_d: 2
    try:
        _check_update(triton_device, case)
    finally:
        triton_update.fan = fan


def _check_update(triton_device, case):
    from freescale.kernels.triton_update import sparse_update

    slots, grads, weight, frozen, per_table, opt = case
    if per_table:
        lr, bc = torch.tensor([0.05, 0.2]), (torch.tensor([0.5, 0.9]), torch.tensor([0.3, 0.7]))
        if isinstance(opt, RowwiseAdagrad):
            bc = (torch.ones(2), torch.ones(2))  # Adagrad has no bias correction
        if isinstance(opt, SGD):
            bc = (torch.ones(2), torch.ones(2))
        extra = {"table_bounds": torch.tensor([4]).to(triton_device)}
        dev_lr, dev_bc = lr.to(triton_device), tuple(b.to(triton_device) for b in bc)
    else:
        lr, bc, extra = 0.1, (0.9, 0.99), {}
        if not isinstance(opt, Adam):
            bc = (1.0, 1.0)
        dev_lr, dev_bc = lr, bc
    want_w = weight.clone()
    want_state = make_state(opt, weight.shape[0], weight.shape[1], torch.device("cpu"))
    for t in want_state.values():  # non-trivial state
        t.add_(0.25)
    got = []
    for _ in range(2):
        w = weight.clone().to(triton_device)
        state = {k: v.clone().to(triton_device) for k, v in want_state.items()}
        sparse_update(
            w,
            list(state.values()),
            slots.to(triton_device),
            grads.to(triton_device),
            lr=dev_lr,
            bc=dev_bc,
            frozen=frozen.to(triton_device),
            **opt.kernel_spec(),
            **extra,
        )
        got.append((w.cpu(), {k: v.cpu() for k, v in state.items()}))
    reference(opt, want_w, want_state, slots, grads, frozen, lr, bc)
    (w1, s1), (w2, s2) = got
    assert torch.equal(w1, w2) and all(torch.equal(s1[k], s2[k]) for k in s1)  # reproducible
    weight_tol, state_tol = update_tol(slots, grads, weight.shape[0])
    torch.testing.assert_close(w1, want_w, **weight_tol)
    for k in want_state:
        torch.testing.assert_close(s1[k], want_state[k], **state_tol)
    untouched = torch.ones(weight.shape[0], dtype=torch.bool)
    untouched[slots.unique()] = False
    untouched[frozen] = True
    assert torch.equal(w1[untouched], weight[untouched])  # rows nobody sent stay bit-equal


def test_kernel_specs_cover_every_optimizer():
    from freescale.kernels.triton_update import DECAY_MODES, KINDS

    for opt in OPTIMIZERS:
        assert opt.kernel_spec()["kind"] in KINDS
        assert "weight_decay" not in opt.kernel_spec()  # no decay: the undecayed kernel
    for opt in DECAYED:
        assert opt.kernel_spec()["decay_mode"] in DECAY_MODES
        assert opt.kernel_spec()["weight_decay"] > 0
    with pytest.raises(KeyError):
        KINDS["adamw"]


def _subset_case(seed: int):
    """Slots with several hot runs (each spans chunks) interleaved with cold ones."""
    g = torch.Generator().manual_seed(seed)
    rows, dim = 9, 3
    slots = torch.cat([torch.randint(0, rows, (40,), generator=g), torch.full((75,), 2)])
    slots = torch.cat([slots, torch.full((45,), 5)])
    slots = slots[torch.randperm(slots.numel(), generator=g)]
    grads = torch.randn(slots.numel(), dim, generator=g) * 1e3
    weight = torch.randn(rows, dim, generator=g)
    subset = torch.rand(rows, generator=g) < 0.5
    subset[2], subset[5] = True, False  # one hot run on each side
    return slots, grads, weight, subset


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("opt", OPTIMIZERS + DECAYED, ids=["sgd", "adagrad", "adam", *DECAYED_IDS])
def test_update_of_disjoint_row_subsets_equals_one_update(triton_device, seed, opt):
    """A row's sum depends only on its own contributions: updating the rows in two
    disjoint subsets (same contributions, same order) is bitwise one update
    (what prioritized updates do with collision and exclusive rows)."""
    from freescale.kernels.triton_update import sparse_update

    slots, grads, weight, subset = _subset_case(seed)
    lr, bc = 0.1, ((0.9, 0.99) if isinstance(opt, Adam) else (1.0, 1.0))
    spec = opt.kernel_spec()
    results = []
    for parts in ([torch.ones_like(slots, dtype=torch.bool)], None):
        if parts is None:
            first = subset[slots]
            parts = [first, ~first]
        w = weight.clone().to(triton_device)
        state = make_state(opt, weight.shape[0], weight.shape[1], w.device)
        for keep in parts:
            s, gr = slots[keep].to(triton_device), grads[keep].to(triton_device)
            sparse_update(w, list(state.values()), s, gr, lr=lr, bc=bc, **spec)
        results.append((w.cpu(), {k: v.cpu() for k, v in state.items()}))
    (w_one, s_one), (w_two, s_two) = results
    assert torch.equal(w_one, w_two)
    assert all(torch.equal(s_one[k], s_two[k]) for k in s_one)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("opt", OPTIMIZERS + DECAYED, ids=["sgd", "adagrad", "adam", *DECAYED_IDS])
def test_skip_flag_leaves_rows_and_state_alone(triton_device, opt, skip):
    """A true device flag (a non-finite step, `freescale.embedding.nonfinite`)
    changes no row and no state, in the Triton and torch paths; a false one is
    the plain update, bit for bit."""
    from freescale.kernels.triton_update import sparse_update

    slots, grads, weight, _ = _subset_case(3)
    if skip:
        grads[5] = float("nan")  # what the guard would have seen
    bc = (0.9, 0.99) if isinstance(opt, Adam) else (1.0, 1.0)
    state0 = make_state(opt, weight.shape[0], weight.shape[1], torch.device("cpu"))
    for t in state0.values():
        t.add_(0.25)
    results = {}
    for path in ("triton", "torch"):
        for flag in (torch.tensor(skip), None):
            w = weight.clone()
            state = {k: v.clone() for k, v in state0.items()}
            if path == "triton":
                w, state = w.to(triton_device), {k: v.to(triton_device) for k, v in state.items()}
                flag_dev = None if flag is None else flag.to(triton_device)
                sparse_update(w, list(state.values()), slots.to(triton_device),
                              grads.to(triton_device), lr=0.1, bc=bc, skip=flag_dev,
                              **opt.kernel_spec())  # fmt: skip
            else:
                rows, summed = sum_duplicates(slots, grads)
                apply_rows(opt, w, state, rows, summed, 0.1, bc, flag)
            results[(path, flag is None)] = (w.cpu(), {k: v.cpu() for k, v in state.items()})
    for path in ("triton", "torch"):
        w, state = results[(path, False)]
        want_w, want_state = (weight, state0) if skip else results[(path, True)]
        assert torch.equal(w, want_w), path
        assert all(torch.equal(state[k], want_state[k]) for k in state), path


@pytest.mark.parametrize("case", list(formulas.CASES))
def test_triton_update_follows_the_optimizer_formula(triton_device, case):
    """The kernel against the optimizers written out in float64 (large eps,
    near-zero state: `tests/embedding/_optim_formulas.py`), three steps; the
    parity test above would not see eps moved under the square root at eps 1e-8."""
    from freescale.kernels.triton_update import sparse_update

    opt = formulas.CASES[case]
    rows, dim, steps = 7, 4, 3
    weight = torch.randn(rows, dim, generator=torch.Generator().manual_seed(1))
    updates = formulas.updates(2, rows, dim, steps)
    w = weight.clone().to(triton_device)
    state = make_state(opt, rows, dim, w.device)
    for t, (slots, grads) in enumerate(updates, start=1):
        sparse_update(w, list(state.values()), slots.to(triton_device), grads.to(triton_device),
                      lr=opt.lr_at(t), bc=opt.bias_corrections(t), **opt.kernel_spec())  # fmt: skip
    want_w, want_state = formulas.run(opt, weight, updates)
    assert_reordered_close(w.cpu(), want_w.float(), terms=dim, depth=steps)
    for name, want in want_state.items():
        assert_reordered_close(state[name].cpu(), want.float(), terms=dim, depth=steps, msg=name)


@pytest.mark.parametrize("hot", [31, 32, 33, 100, 200])
def test_triton_update_sums_every_piece_of_a_hot_row(triton_device, hot):
    """A row sent ``hot`` times (runs cut into pieces of CHUNK = 32 around the
    edges, and into several tiles of pieces) gets the sum of all its
    gradients: SGD against float64."""
    from freescale.kernels.triton_update import sparse_update

    g = torch.Generator().manual_seed(hot)
    slots = torch.cat([torch.full((hot,), 1), torch.tensor([0, 3, 3])])
    slots = slots[torch.randperm(slots.numel(), generator=g)]
    grads = torch.randn(slots.numel(), 3, generator=g)
    weight = torch.randn(4, 3, generator=g)
    w = weight.clone().to(triton_device)
    sparse_update(w, [], slots.to(triton_device), grads.to(triton_device), lr=0.5, bc=(1.0, 1.0),
                  **SGD(lr=0.5).kernel_spec())  # fmt: skip
    want = weight.double()
    want.index_add_(0, slots, grads.double(), alpha=-0.5)
    magnitude = abs_sum(grads[slots == 1]) + float(weight.abs().max())  # the hot row's sum
    assert_reordered_close(w.cpu(), want.float(), terms=hot + 1, magnitude=magnitude)
