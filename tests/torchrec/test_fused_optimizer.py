"""`FusedOptimizer`: the in-backward update behind the usual torch.optim API."""

import pytest
import torch

from freescale.comm import run_threads
from freescale.embedding import (
    SGD,
    Adam,
    RowwiseAdagrad,
    ShardedEmbeddingCollection,
    ShardingPlan,
    TableConfig,
)
from freescale.jagged import JaggedTensor
from freescale.torchrec.fused_optimizer import (
    FusedOptimizer,
    from_fused_params,
    set_gradient_division,
)

STEPS = 4


def test_from_fused_params_maps_torchrec_names():
    fbgemm = pytest.importorskip("fbgemm_gpu.split_embedding_configs")
    E = fbgemm.EmbOptimType
    assert from_fused_params({"optimizer": E.EXACT_SGD, "learning_rate": 0.2}) == SGD(lr=0.2)
    got = from_fused_params(
        {"optimizer": E.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "eps": 1e-6}
    )
    assert got == RowwiseAdagrad(lr=0.1, eps=1e-6)
    got = from_fused_params(
        {"optimizer": "adam", "learning_rate": 1e-3, "beta1": 0.8, "beta2": 0.99, "eps": 1e-7}
    )
    assert got == Adam(lr=1e-3, beta1=0.8, beta2=0.99, eps=1e-7)
    assert from_fused_params({"optimizer": "sgd", "output_dtype": None}) == SGD()


def test_from_fused_params_maps_weight_decay_as_fbgemm_applies_it():
    fbgemm = pytest.importorskip("fbgemm_gpu.split_embedding_configs")
    modes = pytest.importorskip("fbgemm_gpu.tbe.config.optimizer_config").WeightDecayMode
    E = fbgemm.EmbOptimType
    base = {"optimizer": E.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1, "weight_decay": 0.01}
    got = from_fused_params({**base, "weight_decay_mode": modes.L2})
    assert got == RowwiseAdagrad(lr=0.1, weight_decay=0.01, weight_decay_mode="l2")
    got = from_fused_params({**base, "weight_decay_mode": "decouple"})
    assert got == RowwiseAdagrad(lr=0.1, weight_decay=0.01, weight_decay_mode="decoupled")
    got = from_fused_params({"optimizer": E.ADAM, "weight_decay": 0.02, "weight_decay_mode": 2})
    assert got == Adam(weight_decay=0.02)  # FBGEMM's Adam: decoupled
    assert from_fused_params({"optimizer": "adam", "weight_decay": 0.02}) == Adam(weight_decay=0.02)
    # Zero decay: whatever the mode, the plain optimizer.
    assert from_fused_params({**base, "weight_decay": 0.0}) == RowwiseAdagrad(lr=0.1)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"learning_rate": 0.1}, "'optimizer' is required"),
        ({"optimizer": "lamb"}, "optimizer 'lamb' is not one of"),
        ({"optimizer": "exact_sgd", "weight_decay": 0.01}, "'weight_decay' does not apply"),
        (
            {"optimizer": "exact_row_wise_adagrad", "weight_decay": 0.01},
            "weight_decay_mode NONE has no effect",
        ),
        (
            {"optimizer": "exact_row_wise_adagrad", "weight_decay": 0.1, "weight_decay_mode": 3},
            "'weight_decay_mode' = COUNTER is not supported",
        ),
        (
            {"optimizer": "adam", "weight_decay": 0.1, "weight_decay_mode": "L2"},
            "FBGEMM's Adam decays decoupled",
        ),
        ({"optimizer": "exact_sgd", "eps": 1e-8}, "key 'eps' does not apply"),
        ({"optimizer": "exact_sgd", "gradient_clipping": True}, "'gradient_clipping' is not"),
    ],
)
def test_from_fused_params_refuses_what_it_cannot_reproduce(params, match):
    with pytest.raises(ValueError, match=match):
        from_fused_params(params)


def _ids(rank: int, step: int) -> JaggedTensor:
    g = torch.Generator().manual_seed(rank * 100 + step)
    lengths = torch.randint(0, 4, (3,), generator=g)
    return JaggedTensor.from_lengths(
        torch.randint(0, 9, (int(lengths.sum()),), generator=g), lengths
    )


def _collection(comm, opt):
    tables = [TableConfig("a", 9, 2), TableConfig("b", 9, 3)]
    return ShardedEmbeddingCollection(tables, comm, ShardingPlan(optimizer=opt), seed=3)


def _train(coll, steps=STEPS, on_step=None):
    for step in range(steps):
        x = _ids(coll.comm.rank, step)
        out = coll({"a": x, "b": x})
        (out["a"].values.sum() + (out["b"].values ** 2).sum()).backward()
        if on_step is not None:
            on_step()


def _scheduler_rank(comm):
    # Reference twin: the config's own lr hook, lr 0.5 * 0.5**(step-1).
    ref = _collection(comm, SGD(lr=0.0, lr_schedule=lambda s: 0.5 * 0.5 ** (s - 1)))
    _train(ref)
    coll = _collection(comm, SGD(lr=0.5))
    opt = FusedOptimizer(coll)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def step():
        opt.step()
        sched.step()

    _train(coll, on_step=step)
    lrs = [g["lr"] for g in opt.param_groups]
    return [ref.full_table(t) for t in "ab"], [coll.full_table(t) for t in "ab"], lrs


def test_lr_scheduler_drives_the_fused_update():
    for ref, got, lrs in run_threads(_scheduler_rank, 2):
        assert lrs == [0.5 * 0.5**STEPS] * 2  # two groups: dims 2 and 3
        for r, g in zip(ref, got, strict=True):
            assert torch.equal(g, r)


def _hyper_rank(comm):
    # Every hyperparameter a param group shows is live, not only lr: the
    # reference twin has the changed values in its config from the start.
    ref = _collection(comm, Adam(lr=0.1, beta1=0.5, beta2=0.75, eps=1e-3, weight_decay=0.25))
    _train(ref)
    coll = _collection(comm, Adam(lr=0.1))
    opt = FusedOptimizer(coll)
    for g in opt.param_groups:
        g.update(betas=(0.5, 0.75), eps=1e-3, weight_decay=0.25)
    _train(coll)
    # A loaded state dict's hyperparameters apply as well.
    resumed = _collection(comm, Adam(lr=0.1))
    resumed.load_state_dict(coll.state_dict())
    FusedOptimizer(resumed).load_state_dict(opt.state_dict())
    before = [(ref.full_table(t), coll.full_table(t)) for t in "ab"]
    _train(coll, steps=1)
    _train(resumed, steps=1)
    after = [(coll.full_table(t), resumed.full_table(t)) for t in "ab"]
    again = FusedOptimizer(coll).param_groups[0]  # a second handle shows the live values
    assert (again["betas"], again["eps"], again["weight_decay"]) == ((0.5, 0.75), 1e-3, 0.25)
    return before + after


def test_every_param_group_hyperparameter_is_live():
    for tables in run_threads(_hyper_rank, 2):
        for ref, got in tables:
            assert torch.equal(got, ref)


def _bad_hyper_rank(comm):
    coll = _collection(comm, RowwiseAdagrad(lr=0.1))
    opt = FusedOptimizer(coll)
    opt.param_groups[0]["weight_decay"] = -1.0
    with pytest.raises(ValueError, match="weight_decay must be finite and >= 0"):
        _train(coll, steps=1)
    return True


def test_a_bad_param_group_value_fails_at_the_next_update():
    assert run_threads(_bad_hyper_rank, 2) == [True, True]


def _state_rank(comm):
    coll = _collection(comm, RowwiseAdagrad(lr=0.3))
    opt = FusedOptimizer(coll)
    _train(coll)
    opt.param_groups[0]["lr"] = 0.05
    sd = opt.state_dict()
    other = _collection(comm, RowwiseAdagrad(lr=0.3))
    opt2 = FusedOptimizer(other)
    opt2.load_state_dict(sd)
    bad = {"state": dict(sd["state"]), "param_groups": sd["param_groups"]}
    del bad["state"]["a.optimizer.sum_sq"]
    with pytest.raises(ValueError, match=r"missing.*a.optimizer.sum_sq"):
        opt2.load_state_dict(bad)
    return (
        sorted(sd["state"]),
        [coll.full_optimizer_state(t)["sum_sq"] for t in "ab"],
        [other.full_optimizer_state(t)["sum_sq"] for t in "ab"],
        [other.step_of(t) for t in "ab"],
        [g["lr"] for g in opt2.param_groups],
        [g["tables"] for g in opt2.param_groups],
    )


def test_fused_optimizer_state_dict_round_trips():
    for keys, saved, loaded, steps, lrs, tables in run_threads(_state_rank, 2):
        assert keys == [f"{t}.optimizer.{k}" for t in "ab" for k in ("step", "sum_sq")]
        assert all(s.max() > 0 for s in saved)
        for s, l in zip(saved, loaded, strict=True):
            assert torch.equal(s, l)
        assert steps == [STEPS, STEPS]
        assert lrs == [0.05, 0.3] and tables == [["a"], ["b"]]


def _division_rank(comm):
    ref = _collection(comm, SGD(lr=0.25))  # lr / world size
    _train(ref)
    coll = _collection(comm, SGD(lr=0.5))
    set_gradient_division(coll, True)
    _train(coll)
    off = _collection(comm, SGD(lr=0.5))
    set_gradient_division(off, True)
    set_gradient_division(off, False)
    _train(off)
    plain = _collection(comm, SGD(lr=0.5))
    _train(plain)
    return [
        (ref.full_table(t), coll.full_table(t), off.full_table(t), plain.full_table(t))
        for t in "ab"
    ]


@pytest.mark.numeric
def test_gradient_division_divides_by_the_world_size():
    for per_table in run_threads(_division_rank, 2):
        for ref, got, off, plain in per_table:
            assert torch.equal(got, ref)  # g / 2 and lr / 2: exact, the same products
            assert torch.equal(off, plain) and not torch.equal(got, plain)
