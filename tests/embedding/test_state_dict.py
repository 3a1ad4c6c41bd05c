"""After `swap`, ``model.state_dict()`` holds every table and its optimizer state, in
logical row order: DCP checkpoints reshard between world sizes."""

import copy
import io

import pytest
import torch
from torch import nn

from freescale.comm import TorchCommunicator, run_threads
from freescale.embedding import RowSharding, RowwiseAdagrad, ShardingPlan, swap
from freescale.embedding.state.state_dict import chunk_bounds, from_row_chunks, to_row_chunks
from freescale.testing import run_ranks
from tests.embedding._train import pack, unpack


def _exchange_rank(comm, sharding: RowSharding, table: torch.Tensor):
    ids = sharding.global_ids(comm.rank)
    local = torch.zeros(sharding.local_rows, *table.shape[1:])
    local[ids >= 0] = table[ids[ids >= 0]]
    chunk = to_row_chunks(sharding, comm, local)
    return local, chunk, from_row_chunks(sharding, comm, chunk)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 2, 7, 10])
@pytest.mark.parametrize(("kind", "block"), [("hashed", 1), ("hashed", 3), ("block", 1)])
def test_row_chunks_match_slicing_the_whole_table(world, rows, kind, block):
    table = torch.randn(rows, 2, generator=torch.Generator().manual_seed(rows))
    sharding = RowSharding(rows, world, kind, block)
    for rank, (local, chunk, back) in enumerate(
        run_threads(_exchange_rank, world, sharding, table)
    ):
        lo, hi = chunk_bounds(rows, world, rank)
        assert torch.equal(chunk, table[lo:hi])  # reference: a slice of the whole table
        assert torch.equal(back, local)
    # The DTensor Shard(0) cut: torch.chunk's sizes, then empty chunks.
    expected = [len(c) for c in torch.arange(rows).chunk(world)]
    expected += [0] * (world - len(expected))
    assert [hi - lo for lo, hi in (chunk_bounds(rows, world, r) for r in range(world))] == expected


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(11, 3)
        self.user = nn.Embedding(5, 3)

    def forward(self, items, users):
        return (self.item(items).sum(1) * self.user(users)).sum()


def _model() -> Two:
    torch.manual_seed(0)
    return Two()


def _train(model: nn.Module, steps: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        model(torch.randint(0, 11, (4, 2), generator=g), torch.randint(0, 5, (4,), generator=g))
        model(torch.randint(0, 11, (4, 2), generator=g), torch.randint(0, 5, (4,), generator=g))
        loss = model(
            torch.randint(0, 11, (4, 2), generator=g), torch.randint(0, 5, (4,), generator=g)
        )
        loss.backward()


PLAN = ShardingPlan(optimizer=RowwiseAdagrad(lr=0.1), block_size=2)
KEYS = {
    f"{m}.{k}" for m in ("item", "user") for k in ("weight", "optimizer.sum_sq", "optimizer.step")
}


def _threads_rank(comm, model: Two, plain: Two):
    model = copy.deepcopy(model)
    coll = swap(model, PLAN, comm)
    sd = model.state_dict()
    other = copy.deepcopy(plain)
    coll2 = swap(other, PLAN, comm)
    # A plain, unsharded model's weights load into the sharded tables.
    missing, unexpected = other.load_state_dict(plain.state_dict(), strict=False)
    loaded = coll2.full_table("item")
    return sd, coll.full_table("item"), (sorted(missing), unexpected), loaded


def test_swapped_model_state_dict_holds_the_tables_threads():
    model, plain = _model(), _model()
    with torch.no_grad():
        plain.item.weight.mul_(-2.0)
    for sd, item, (missing, unexpected), loaded in run_threads(_threads_rank, 2, model, plain):
        assert set(sd) == KEYS
        assert torch.equal(sd["item.weight"], item)
        assert torch.equal(sd["item.weight"], model.item.weight.detach())
        assert sd["item.optimizer.sum_sq"].shape == (11,) and int(sd["item.optimizer.step"]) == 0
        # A plain model's state dict has no optimizer state: reported, not dropped.
        assert missing == sorted(k for k in KEYS if "optimizer" in k) and unexpected == []
        assert torch.equal(loaded, plain.item.weight.detach())


def _save_rank(path: str, model: Two) -> bytes:
    import torch.distributed.checkpoint as dcp

    coll = swap(model, PLAN, TorchCommunicator())
    _train(model, 3, torch.distributed.get_rank())
    sd = model.state_dict()
    dcp.save(sd, checkpoint_id=path)
    full = {n: coll.full_table(n) for n in ("item", "user")}
    full.update({f"{n}.sum_sq": coll.full_optimizer_state(n)["sum_sq"] for n in ("item", "user")})
    full["steps"] = torch.tensor([coll.step_of("item"), coll.step_of("user")])
    return pack(
        {"full": full, "keys": sorted(sd), "types": {k: type(v).__name__ for k, v in sd.items()}}
    )


def _load_rank(path: str, model: Two) -> bytes:
    import torch.distributed.checkpoint as dcp

    coll = swap(model, PLAN, TorchCommunicator())
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=path)
    model.load_state_dict(sd)
    full = {n: coll.full_table(n) for n in ("item", "user")}
    full.update({f"{n}.sum_sq": coll.full_optimizer_state(n)["sum_sq"] for n in ("item", "user")})
    full["steps"] = torch.tensor([coll.step_of("item"), coll.step_of("user")])
    return pack(full)


def test_dcp_checkpoint_saved_at_2_ranks_loads_at_1_and_4(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = [unpack(x) for x in run_ranks(_save_rank, 2, path, _model(), timeout=90)]
    assert saved[0]["keys"] == sorted(KEYS)
    assert saved[0]["types"]["item.weight"] == "DTensor"
    expected = saved[0]["full"]
    assert int(expected["steps"][0]) == 3
    assert not torch.equal(expected["item"], _model().item.weight.detach())  # it trained
    for world in (1, 4):
        for got in [unpack(x) for x in run_ranks(_load_rank, world, path, _model(), timeout=90)]:
            assert set(got) == set(expected)
            for k, v in expected.items():
                assert torch.equal(got[k], v), (world, k)


def _torch_save_rank(model: Two) -> bytes:
    coll = swap(model, PLAN, TorchCommunicator())
    _train(model, 2, torch.distributed.get_rank())
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # one rank's file: DTensors hold its chunks only
    buf.seek(0)
    restored = torch.load(buf, weights_only=False)
    other = copy.deepcopy(_model())
    coll2 = swap(other, PLAN, TorchCommunicator())
    other.load_state_dict(restored)
    return pack(
        {"a": coll.full_table("item"), "b": coll2.full_table("item"), "keys": sorted(restored)}
    )


def test_torch_save_of_the_state_dict_keeps_every_table():
    for r in [unpack(x) for x in run_ranks(_torch_save_rank, 2, _model(), timeout=90)]:
        assert r["keys"] == sorted(KEYS)
        assert torch.equal(r["a"], r["b"])


def _mismatch_rank(comm, model: Two):
    model = copy.deepcopy(model)
    swap(model, PLAN, comm)
    sd = model.state_dict()
    sd["item.weight"] = torch.zeros(12, 3)
    with pytest.raises(RuntimeError, match=r"item.weight: saved with 12 rows, the table has 11"):
        model.load_state_dict(sd)
    sd = model.state_dict()
    sd["item.optimizer.exp_avg"] = torch.zeros(11, 3)  # Adam state into an Adagrad table
    with pytest.raises(RuntimeError, match=r"Unexpected key.*item.optimizer.exp_avg"):
        model.load_state_dict(sd)
    return True


def test_load_state_dict_mismatches_fail_loudly():
    assert run_threads(_mismatch_rank, 2, _model()) == [True, True]


def _one_rank_rank(model: Two) -> bytes:
    """Rank 0 alone asks for the state dict; then rank 1 alone, too late for that round."""
    import torch.distributed as dist

    from freescale.embedding import rank_agreement

    rank_agreement.TIMEOUT_S = 2.0  # the default (10 s) only makes the test slower
    swap(model, PLAN, TorchCommunicator())
    _train(model, 1, dist.get_rank())
    keys = sorted(model.state_dict())  # every rank: the agreement holds
    errors = {}
    for alone in (0, 1):
        if dist.get_rank() == alone:
            try:
                model.state_dict()
            except RuntimeError as e:
                errors[alone] = str(e)
        dist.barrier()  # the other rank waits here, far from any exchange
    return pack({"keys": keys, "errors": errors})


def test_state_dict_on_one_rank_fails_fast_and_loudly_not_a_hang():
    """A plain torch.save(model.state_dict()) on rank 0 only: before, rank 0 blocked in
    the first AllToAll until the process group's timeout; now a RuntimeError says why
    (run_ranks' timeout, the group's too, catches a hang)."""
    per_rank = [unpack(x) for x in run_ranks(_one_rank_rank, 2, _model(), timeout=60)]
    assert per_rank[0]["keys"] == sorted(KEYS)
    first = per_rank[0]["errors"][0]
    assert "every rank must call it (ranks [1] did not call it within 2 s)" in first
    assert "tables_left_out()" in first and "dcp.save" in first
    # Rank 1 reaches the round rank 0 gave up on: it raises too, rather than
    # entering an exchange nobody else is in.
    assert "a rank was more than 2 s late" in per_rank[1]["errors"][1]
    assert set(per_rank[0]["errors"]) == {0} and set(per_rank[1]["errors"]) == {1}
