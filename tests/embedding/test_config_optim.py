import pytest
import torch

from freescale.embedding import SGD, Adam, RowwiseAdagrad, ShardingPlan, TableConfig
from freescale.embedding.optim import apply_rows, make_state


@pytest.mark.parametrize(
    "make",
    [
        lambda: TableConfig("", 3, 2),
        lambda: TableConfig("t", 0, 2),
        lambda: TableConfig("t", 3, 0),
        lambda: TableConfig("t", 3, 2, dtype=torch.int64),
        lambda: TableConfig("t", 3, 2, padding_idx=3),
        lambda: TableConfig("t", 3, 2, feature_names=("a", "a")),
        lambda: ShardingPlan(assignment="random"),
        lambda: ShardingPlan(block_size=0),
        lambda: SGD(lr=-1.0),
        lambda: SGD(lr_schedule=3),
        lambda: RowwiseAdagrad(eps=0.0),
        lambda: Adam(beta1=1.0),
    ],
)
def test_invalid_configs_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


def test_plan_optimizer_resolution_and_module_selection():
    plan = ShardingPlan(optimizer=SGD(lr=1.0), table_optimizers={"b": Adam()}, modules=("enc.*",))
    assert plan.optimizer_for(TableConfig("a", 3, 2)) == SGD(lr=1.0)
    assert plan.optimizer_for(TableConfig("b", 3, 2)) == Adam()
    assert plan.optimizer_for(TableConfig("b", 3, 2, optimizer=SGD(lr=2.0))) == SGD(lr=2.0)
    assert plan.selects("enc.items") and not plan.selects("dec.items")
    assert ShardingPlan().selects("anything")


def test_lr_schedule_hook():
    opt = SGD(lr=1.0, lr_schedule=lambda step: 0.5**step)
    assert opt.lr_at(1) == 0.5 and opt.lr_at(3) == 0.125
    assert SGD(lr=0.1).lr_at(100) == 0.1
    with pytest.raises(ValueError, match="returned nan"):
        SGD(lr_schedule=lambda step: float("nan")).lr_at(1)


@pytest.mark.parametrize("opt", [SGD(lr=0.1), RowwiseAdagrad(lr=0.1), Adam(lr=0.1)])
def test_only_touched_rows_change(opt):
    weight = torch.randn(6, 4, dtype=torch.bfloat16)
    state = make_state(opt, 6, 4, torch.device("cpu"))
    w0, s0 = weight.clone(), {k: v.clone() for k, v in state.items()}
    rows = torch.tensor([1, 4])
    apply_rows(opt, weight, state, rows, torch.ones(2, 4), 0.1, opt.bias_corrections(1))
    untouched = torch.tensor([0, 2, 3, 5])
    assert torch.equal(weight[untouched], w0[untouched])
    assert not torch.equal(weight[rows], w0[rows])
    for k, v in state.items():
        assert v.dtype == torch.float32
        assert torch.equal(v[untouched], s0[k][untouched])
        assert not torch.equal(v[rows], s0[k][rows])
