"""Each row-wise optimizer computes its formula (`tests/embedding/_optim_formulas.py`).

The store's update (duplicate sums, then `freescale.embedding.optim`) against
the optimizers written out independently in float64, over three steps with
duplicated and untouched rows, with a large eps and near-zero initial state:
eps added under the square root instead of to it, a bias correction for the
other moment, the decay applied to the new row, the accumulator updated after
its use... each moves the rows by far more than the float32 tolerance. The
Triton update kernel is held to the same formulas in `tests/kernels/test_update.py`.
"""

from __future__ import annotations

import pytest
import torch

from freescale.embedding.config import TableConfig
from freescale.embedding.store import ShardStore
from freescale.kernels.shard import RowSharding
from freescale.testing.tolerance import assert_reordered_close
from tests.embedding import _optim_formulas as formulas

ROWS, DIM, STEPS = 7, 4, 3


def _store(opt, weight: torch.Tensor) -> ShardStore:
    table = TableConfig("t", ROWS, DIM, torch.float32)
    store = ShardStore([table], [RowSharding(ROWS, 1)], opt, 0, torch.device("cpu"))
    store.weight.copy_(weight)
    return store


def check_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """float32 results against float64 ones: rounding of a few chained
    operations per step (terms: the row's D-long mean; depth: the steps)."""
    assert set(got) == set(want)
    for name, w in want.items():
        assert_reordered_close(got[name], w.float(), terms=DIM, depth=STEPS, msg=name)


@pytest.mark.parametrize("case", list(formulas.CASES))
def test_store_update_follows_the_optimizer_formula(case):
    opt = formulas.CASES[case]
    weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(1))
    steps = formulas.updates(2, ROWS, DIM, STEPS)
    store = _store(opt, weight)
    for slots, grads in steps:
        store.apply_gradients(slots, grads, [0])
    want_w, want_state = formulas.run(opt, weight, steps)
    check_close({"weight": store.weight, **store.optimizer_state()},
                {"weight": want_w, **want_state})  # fmt: skip
    assert store.steps.tolist() == [STEPS]
    assert torch.equal(store.weight[ROWS - 1], weight[ROWS - 1])  # never touched: never moved


@pytest.mark.parametrize("case", ["sgd-scheduled", "adam"])
def test_tables_at_different_steps_each_use_their_own_step(case):
    """Two tables in one store, the second updated from the second step on: every
    row follows the formula at its own table's step, the second table's first
    row (the boundary of the per-row hyperparameters) included."""
    opt = formulas.CASES[case]
    g = torch.Generator().manual_seed(4)
    rows = (4, 3)
    tables = [TableConfig(name, n, DIM, torch.float32) for name, n in zip("ab", rows, strict=True)]
    store = ShardStore(tables, [RowSharding(n, 1) for n in rows], opt, 0, torch.device("cpu"))
    weights = [torch.randn(n, DIM, generator=g) for n in rows]
    store.weight.copy_(torch.cat(weights))
    per_table: list[list] = [[], []]
    for step in range(STEPS):
        touched = [0] if step == 0 else [0, 1]
        slots, grads = [], []
        for t in touched:
            local = torch.cat([torch.tensor([0]), torch.randint(0, rows[t], (5,), generator=g)])
            grad = torch.randn(local.numel(), DIM, generator=g)
            per_table[t].append((local, grad))
            slots.append(local + store.starts[t])
            grads.append(grad)
        store.apply_gradients(torch.cat(slots), torch.cat(grads), touched)
    assert store.steps.tolist() == [STEPS, STEPS - 1]
    for t in range(2):
        want_w, want_state = formulas.run(opt, weights[t], per_table[t])
        got = {k: store.table_slice(t, v) for k, v in store.optimizer_state().items()}
        check_close({"weight": store.table_slice(t, store.weight), **got},
                    {"weight": want_w, **want_state})  # fmt: skip


def test_padding_rows_never_move():
    """A table's padding row is frozen: gradients sent to it change neither the
    row nor its optimizer state; the other rows follow the formula."""
    opt = formulas.CASES["adam"]
    table = TableConfig("t", ROWS, DIM, torch.float32, padding_idx=2)
    store = ShardStore([table], [RowSharding(ROWS, 1)], opt, 0, torch.device("cpu"))
    weight = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(5))
    store.weight.copy_(weight)
    steps = formulas.updates(6, ROWS, DIM, STEPS)
    for slots, grads in steps:
        store.apply_gradients(torch.cat([slots, torch.tensor([2])]),
                              torch.cat([grads, torch.ones(1, DIM)]), [0])  # fmt: skip
    assert torch.equal(store.weight[2], weight[2])
    assert all(torch.equal(v[2], torch.zeros_like(v[2])) for v in store.optimizer_state().values())
    want_w, _ = formulas.run(opt, weight, steps)
    others = torch.arange(ROWS) != 2
    assert_reordered_close(store.weight[others], want_w[others].float(), terms=DIM, depth=STEPS)
