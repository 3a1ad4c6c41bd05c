"""`swap` replaces embedding modules in place; the sharded model trains like the original."""

import copy

import pytest
import torch
from torch import nn

from freescale.comm import TorchCommunicator, run_threads
from freescale.embedding import SGD, ShardedEmbedding, ShardingPlan, global_count, swap
from freescale.testing import run_ranks
from freescale.testing.tolerance import steps_tol
from tests.embedding._train import pack, unpack

GLOBAL_B, SPLIT = 7, (5, 0, 2)
LR, STEPS = 0.5, 2
# The longest sum of a step (an item row's duplicates: 3 items per sample) and
# its chained reductions: forward (item mean, tower, head) and backward.
TERMS, DEPTH = 3 * GLOBAL_B, 6


class Tiny(nn.Module):
    """A model whose code knows nothing about sharding."""

    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(37, 6)
        self.tower = nn.Sequential(nn.Linear(6, 4), nn.ReLU())
        self.user = nn.Embedding(11, 4, padding_idx=0)
        self.head = nn.Linear(4, 1)

    def forward(self, items: torch.Tensor, users: torch.Tensor) -> torch.Tensor:
        h = self.tower(self.item(items).mean(1)) + self.user(users)
        return self.head(h).squeeze(-1)


def _model() -> Tiny:
    torch.manual_seed(0)
    return Tiny()


def _data():
    g = torch.Generator().manual_seed(5)
    items = torch.randint(0, 37, (GLOBAL_B, 3), generator=g)
    users = torch.randint(0, 11, (GLOBAL_B,), generator=g)
    users[0] = 0  # the padding row is read but never updated
    return items, users, torch.randn(GLOBAL_B, generator=g)


def _train_step(model, items, users, y, n_global: int) -> torch.Tensor:
    pred = model(items, users)
    loss = ((pred - y) ** 2).sum() / n_global  # the explicit scaling rule
    loss.backward()
    return pred.detach()


def _swap_rank_gloo(model: Tiny) -> bytes:
    return _swap_rank(TorchCommunicator(), model)


def _swap_rank(comm, model: Tiny) -> bytes:
    # Models are built by the caller: seeding the global RNG in simulated
    # ranks (threads) would race.
    model = copy.deepcopy(model)
    coll = swap(model, ShardingPlan(optimizer=SGD(lr=LR), block_size=2), comm)
    assert isinstance(model.item, ShardedEmbedding) and isinstance(model.user, ShardedEmbedding)
    items, users, y = _data()
    lo = sum(SPLIT[: comm.rank])
    hi = lo + SPLIT[comm.rank]
    n_global = global_count(comm, hi - lo)
    local = (items[lo:hi], users[lo:hi], y[lo:hi])
    preds = [_train_step(model, *local, n_global) for _ in range(STEPS)]
    tables = {name: coll.full_table(name) for name in ("item", "user")}
    return pack({"preds": preds, "tables": tables, "n_global": n_global, "repr": repr(model)})


def _reference():
    model = _model()
    items, users, y = _data()
    opt = torch.optim.SGD([model.item.weight, model.user.weight], lr=LR)
    preds, grad = [], 0.0
    for _ in range(STEPS):
        opt.zero_grad()
        preds.append(_train_step(model, items, users, y, GLOBAL_B))
        tables = (model.item.weight, model.user.weight)
        grad = max(grad, *(float(p.grad.abs().max()) for p in tables))
        opt.step()
    return preds, {"item": model.item.weight.detach(), "user": model.user.weight.detach()}, grad


def _check(per_rank: list[dict]) -> None:
    """Same math as the unsharded model up to the order of the sums (another
    batch split, gradients summed over ranks): step s's predictions come from
    tables s steps trained, each step moving a row by lr times a sum of up to
    `TERMS` gradient terms of either sign (`steps_tol`)."""
    ref_preds, ref_tables, grad = _reference()
    bounds = [0, SPLIT[0], SPLIT[0] + SPLIT[1], GLOBAL_B]
    table_tol = steps_tol(torch.float32, TERMS, LR * TERMS**0.5 * grad, STEPS, DEPTH)
    for rank, r in enumerate(per_rank):
        assert r["n_global"] == GLOBAL_B
        assert "sharded" in r["repr"]
        for step in range(STEPS):
            expect = ref_preds[step][bounds[rank] : bounds[rank + 1]]
            size = TERMS**0.5 * float(ref_preds[step].abs().max())
            tol = steps_tol(torch.float32, TERMS, size, step + 1, DEPTH)
            torch.testing.assert_close(r["preds"][step], expect, **tol)
        for name, table in ref_tables.items():
            torch.testing.assert_close(r["tables"][name], table, **table_tol)
    assert torch.equal(per_rank[0]["tables"]["user"][0], _model().user.weight[0].detach())


@pytest.mark.numeric
def test_swap_trains_like_the_unsharded_model_gloo():
    _check([unpack(r) for r in run_ranks(_swap_rank_gloo, 3, _model(), timeout=60)])


@pytest.mark.numeric
def test_swap_trains_like_the_unsharded_model_fake():
    _check([unpack(r) for r in run_threads(_swap_rank, 3, _model())])


def _refusals(comm, model: Tiny) -> str:
    with pytest.raises(ValueError, match=r"no nn\.Embedding"):
        swap(nn.Linear(2, 2), ShardingPlan(), comm)
    with pytest.raises(ValueError, match="wrap a bare"):
        swap(nn.Embedding(3, 2), ShardingPlan(), comm)
    tied = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    tied[1].weight = tied[0].weight
    with pytest.raises(ValueError, match="tied weights"):
        swap(tied, ShardingPlan(), comm)
    with pytest.raises(ValueError, match="max_norm"):
        swap(nn.Sequential(nn.Embedding(5, 3, max_norm=1.0)), ShardingPlan(), comm)
    # Module selection by glob: only `item` is swapped.
    model = copy.deepcopy(model)
    swap(model, ShardingPlan(modules=("it*",)), comm)
    assert isinstance(model.item, ShardedEmbedding) and type(model.user) is nn.Embedding
    # A module reachable under two paths is replaced under both.
    shared = nn.Embedding(4, 2)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared)})
    swap(model, ShardingPlan(), comm)
    assert model["a"] is model["b"][0] and isinstance(model["a"], ShardedEmbedding)
    return "ok"


def test_swap_refuses_what_it_cannot_shard():
    assert run_threads(_refusals, 2, _model()) == ["ok", "ok"]


def _torchrec_rank(comm, ec, kjt) -> dict:
    ec = copy.deepcopy(ec)
    model = nn.Sequential(ec)
    coll = swap(model, ShardingPlan(optimizer=SGD(lr=1.0)), comm)
    out = model(kjt)
    sum(jt.values().sum() for jt in out.values()).backward()
    return {"out": out, "t1": coll.full_table("0.t1"), "t2": coll.full_table("0.t2")}


def _two_table_collection(torchrec):
    """t1 (features f1, f2; 10 rows) and t2 (f3; 7 rows), dim 4, on the CPU."""
    configs = [
        torchrec.EmbeddingConfig(
            name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f2"]
        ),
        torchrec.EmbeddingConfig(
            name="t2", embedding_dim=4, num_embeddings=7, feature_names=["f3"]
        ),
    ]
    return torchrec.EmbeddingCollection(tables=configs, device=torch.device("cpu"))


def test_swap_torchrec_embedding_collection():
    torchrec = pytest.importorskip("torchrec")
    torch.manual_seed(0)
    ec = _two_table_collection(torchrec)
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(
        keys=["f1", "f2", "f3"],
        values=torch.tensor([1, 2, 3, 3, 5, 6]),
        lengths=torch.tensor([1, 1, 0, 2, 1, 1]),
    )
    expected = ec(kjt)
    per_rank = run_threads(_torchrec_rank, 2, ec, kjt)
    for r in per_rank:
        for f, jt in expected.items():
            assert torch.equal(r["out"][f].values(), jt.values())
            assert torch.equal(r["out"][f].lengths(), jt.lengths())
    # SGD(lr=1) on sum(): each looked-up row drops by (its count, summed over 2 ranks).
    w1 = ec.embeddings["t1"].weight.detach()
    counts = torch.bincount(torch.tensor([1, 2, 3, 3]), minlength=10).float() * 2
    assert torch.equal(per_rank[0]["t1"], w1 - counts[:, None])  # w - integer: one rounding


def _torchrec_int32_rank() -> bytes:
    import torchrec

    torch.manual_seed(0)
    ec = _two_table_collection(torchrec)
    values = torch.tensor([1, 2, 9, 3, 3, 5, 6, 0])
    lengths = [1, 2, 0, 3, 1, 1]  # stride 2; f2's first sample has 0 ids
    kjts = {
        dt: torchrec.KeyedJaggedTensor(
            keys=["f1", "f2", "f3"], values=values, lengths=torch.tensor(lengths, dtype=dt)
        )
        for dt in (torch.int64, torch.int32)
    }
    expected = ec(kjts[torch.int64])  # the unsharded module, before the swap
    model = nn.Sequential(copy.deepcopy(ec))
    swap(model, ShardingPlan(), TorchCommunicator())
    out = {str(dt): model(kjt) for dt, kjt in kjts.items()}
    out["unsharded"] = expected
    return pack(
        {k: {f: (jt.values(), jt.lengths()) for f, jt in o.items()} for k, o in out.items()}
    )


def test_swap_torchrec_accepts_int32_lengths_gloo():
    pytest.importorskip("torchrec")
    (r,) = [unpack(x) for x in run_ranks(_torchrec_int32_rank, 1, timeout=60)]
    assert set(r["unsharded"]) == {"f1", "f2", "f3"}
    for f, (values, lengths) in r["unsharded"].items():
        assert values.shape[0] == lengths.sum()
        for dt in (torch.int64, torch.int32):
            got_values, got_lengths = r[str(dt)][f]
            assert torch.equal(got_values, values)
            assert torch.equal(got_lengths.to(torch.int64), lengths)


def _nested_rank(comm, ec) -> list[str]:
    model = nn.Sequential(copy.deepcopy(ec))
    return sorted(swap(model, ShardingPlan(), comm).tables)


def test_swap_leaves_an_embedding_collections_own_tables_to_it():
    # Regression: the nn.Embedding modules inside an EmbeddingCollection were
    # swapped too, as extra orphan tables ("0.embeddings.t1").
    torchrec = pytest.importorskip("torchrec")
    torch.manual_seed(0)
    assert run_threads(_nested_rank, 1, _two_table_collection(torchrec)) == [["0.t1", "0.t2"]]
