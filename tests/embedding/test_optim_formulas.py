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
