"""Dynamic tables, from the user's side: raw 64-bit ids, bounded rows, exact in every mode.

A dynamic table given ids sent through a random injective 64-bit map trains
bit-identically to a static table over the original ids whose rows start
from the same values (every mode, optimizer and world size), and below
capacity (evictions every step) the three modes still agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from freescale.comm import run_threads
from freescale.embedding import (
    SGD,
    Adam,
    Prioritized,
    RowwiseAdagrad,
    ShardedEmbeddingCollection,
    ShardingPlan,
    SparseDataDist,
    Sync,
    TableConfig,
    swap,
)
from freescale.embedding.dynamic import DynamicMap, DynamicSpec, initial_rows, table_seed
from freescale.jagged import JaggedTensor

MODES = {"sync": Sync, "sdd": SparseDataDist, "freescale": Prioritized}
OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.3, lr_schedule=lambda s: 0.3 / (1.0 + 0.1 * s)),
    "adagrad": lambda: RowwiseAdagrad(lr=0.2, eps=1e-6, initial_accumulator=0.01),
    "adam": lambda: Adam(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6),
}
ROWS, DIM, SAMPLES, STEPS, SEED = 61, 4, 12, 6, 7
ROOMY = DynamicSpec(ROWS + 3)  # capacity for every id
PLACEMENTS = ("host", "device")


def raw_map(n: int) -> torch.Tensor:
    """A random injective map of ``0..n-1`` into int64, negative ids included."""
    g = torch.Generator().manual_seed(11)
    raw = torch.randint(-(2**63), 2**63 - 1, (4 * n,), generator=g, dtype=torch.int64)
    raw = torch.unique(raw)[torch.randperm(torch.unique(raw).numel(), generator=g)][:n]
    assert raw.numel() == n
    return raw


def batch(step: int, rank: int, world: int, rows: int = ROWS) -> tuple[JaggedTensor, torch.Tensor]:
    """This rank's part of a global batch (uneven: rank ``step % W`` gets none)."""
    g = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(0, 6, (SAMPLES,), generator=g)
    ids = (torch.rand(int(lengths.sum()), generator=g) ** 2 * rows).long()
    target = torch.randn(int(lengths.sum()), DIM, generator=g)
    share = [0 if r == step % world and world > 1 else 1 for r in range(world)]
    bounds = [SAMPLES * sum(share[:r]) // sum(share) for r in range(world + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    a, b = int(offsets[lo]), int(offsets[hi])
    return JaggedTensor.from_lengths(ids[a:b], lengths[lo:hi]), target[a:b]


def train(comm, mode: str, optimizer: str, dynamic: DynamicSpec | None, steps: int = STEPS,
          rows: int = ROWS, placement: str = "device") -> dict:  # fmt: skip
    raw = raw_map(rows)
    table = TableConfig("items", rows, DIM, optimizer=OPTIMIZERS[optimizer](), dynamic=dynamic,
                        placement=placement)  # fmt: skip
    coll = ShardedEmbeddingCollection(
        [table], comm, ShardingPlan(), device=comm.device, seed=SEED, mode=MODES[mode]()
    )
    if dynamic is None:  # the static twin starts where the dynamic rows start
        bound = ROOMY.bound
        coll.set_table(
            "items", initial_rows(table_seed(SEED, "items"), raw, DIM, torch.float32, bound)
        )

    def features(step: int) -> dict:
        ids, _ = batch(step, comm.rank, comm.world_size, rows)
        values = raw[ids.values] if dynamic is not None else ids.values
        return {"items": JaggedTensor(values, ids.offsets)}

    if coll.mode.prefetches:
        coll.prefetch(features(0))
    losses, reads, entries = [], [], []
    for step in range(steps):
        if coll.mode.prefetches and step + 1 < steps:
            coll.prefetch(features(step + 1))
        out = coll(features(step))["items"].values
        coll.prefetch_ids() if coll.mode.prefetches else None
        loss = 0.5 * (out - batch(step, comm.rank, comm.world_size, rows)[1]).pow(2).sum() / SAMPLES
        loss.backward()
        losses.append(loss.item())
        if dynamic is not None:  # between steps: reads and saves see what sync has
            coll.flush()
            with torch.no_grad(), coll.prefetch_disabled():
                reads.append(coll({"items": raw})["items"])
            store = coll.stores[0]
            entries.append(store.dynamic_entries(before=coll.mode.lookahead_mapped()))
    coll.flush()
    if dynamic is None:
        rows_by_id = coll.full_table("items")
        state = coll.full_optimizer_state("items")
    else:
        ids, weights, st = coll.dynamic_rows("items")
        rank_of = {int(r): i for i, r in enumerate(raw)}
        order = torch.tensor([rank_of[int(i)] for i in ids], dtype=torch.int64)
        rows_by_id = {"ids": order, "rows": weights}
        state = st
    names = ("held", "slots", "inserts", "evictions", "not_admitted", "dropped")
    stats = dict(zip(names, coll.dynamic_counts(), strict=True)) if dynamic is not None else {}
    return {"losses": losses, "rows": rows_by_id, "state": state, "stats": stats,
            "reads": reads, "entries": entries}  # fmt: skip


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_a_dynamic_table_over_mapped_ids_trains_like_the_static_table(world, optimizer):
    static = run_threads(train, world, "sync", optimizer, None)
    for mode in MODES:
        dyn = run_threads(train, world, mode, optimizer, ROOMY)
        for got, want in zip(dyn, static, strict=True):
            assert got["losses"] == want["losses"], mode
            order = got["rows"]["ids"]
            assert torch.equal(got["rows"]["rows"], want["rows"][order]), mode
            for k, v in want["state"].items():
                assert torch.equal(got["state"][k], v[order]), (mode, k)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize(("evict", "admit_after", "rows"), [("lru", 1, 300), ("lfu", 1, 300),
                                                           ("lru", 2, 120)])  # fmt: skip
def test_below_capacity_every_mode_is_bit_identical(world, evict, admit_after, rows):
    spec = DynamicSpec(rows // 4, evict=evict, admit_after=admit_after)
    runs = {m: run_threads(train, world, m, "adagrad", spec, 12, rows) for m in MODES}
    assert sum(r["stats"]["evictions"] for r in runs["sync"]) > 10
    if admit_after > 1:
        assert sum(r["stats"]["not_admitted"] for r in runs["sync"]) > 0
    for mode in ("sdd", "freescale"):
        for got, want in zip(runs[mode], runs["sync"], strict=True):
            assert got["losses"] == want["losses"], mode
            assert torch.equal(got["rows"]["ids"], want["rows"]["ids"]), mode
            assert torch.equal(got["rows"]["rows"], want["rows"]["rows"]), mode
            for step, (a, b) in enumerate(zip(got["reads"], want["reads"], strict=True)):
                assert torch.equal(a, b), (mode, step)
            for step, (a, b) in enumerate(zip(got["entries"], want["entries"], strict=True)):
                for k, v in b.items():
                    assert torch.equal(a[k], v), (mode, step, k)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_host_placement_trains_like_device_placement(mode):
    """(sdd maps a host-tier table's next ids ahead, when it stages their rows)"""
    spec = DynamicSpec(75, admit_after=2)
    host, device = (run_threads(train, 2, mode, "adam", spec, 12, 300, p) for p in PLACEMENTS)
    for got, want in zip(host, device, strict=True):
        assert got["losses"] == want["losses"]
        assert torch.equal(got["rows"]["rows"], want["rows"]["rows"])
        for a, b in zip(got["reads"], want["reads"], strict=True):
            assert torch.equal(a, b)


def test_eviction_takes_the_least_recently_used_never_this_call_or_the_one_before():
    m = DynamicMap(DynamicSpec(3), 3, torch.device("cpu"))

    def call(*ids: int) -> list[int]:
        r = m.map(torch.tensor(ids))
        m.commit(r)
        return r.slots.tolist()

    assert call(30, 10) == [1, 0]  # free slots in order, new ids by id
    assert call(20) == [2]
    assert call(40) == [0]  # 10 and 30 last read at call 0; 10 < 30
    r = m.map(torch.tensor([50, 60, 70]))  # 40 is held for the call before: 2 slots free
    assert r.overflow and r.needed == 4
    assert call(50, 40) == [1, 0]  # 30 (call 0) goes before 20 (call 1)
    assert call(60) == [2]  # 20, the only one not read by calls 3 and 4


def test_admission_gives_a_row_on_the_kth_sighting_and_zeros_before():
    m = DynamicMap(DynamicSpec(4, admit_after=3), 4, torch.device("cpu"))
    seen = []
    for _ in range(3):
        r = m.map(torch.tensor([9, 9]))
        m.commit(r)
        seen.append(r.slots.tolist())
    assert seen == [[-1, -1], [-1, -1], [0, 0]]


def test_new_rows_depend_on_seed_and_id_only():
    ids = torch.tensor([5, -(2**63), 2**63 - 1, 5])
    rows = initial_rows(3, ids, 8, torch.float32, 0.5)
    assert torch.equal(rows[0], rows[3]) and not torch.equal(rows[0], rows[1])
    assert torch.equal(initial_rows(3, ids[1:2], 8, torch.float32, 0.5), rows[1:2])
    assert float(rows.abs().max()) <= 0.5


def _full(comm) -> str:
    table = TableConfig("items", 8, DIM, dynamic=DynamicSpec(4 * comm.world_size))
    coll = ShardedEmbeddingCollection([table], comm, ShardingPlan(), device=comm.device)
    ids = torch.arange(40) * 7919  # about ten per shard
    try:
        coll({"items": ids}).sum().backward()
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("world", [1, 2])
def test_a_full_shard_is_one_line_on_every_rank(world):
    lines = run_threads(_full, world)
    assert len(set(lines)) == 1 and "\n" not in lines[0]
    assert lines[0].startswith("dynamic table 'items' is full on rank 0 at step 0: its ids need")


@pytest.mark.parametrize("bad", [{"capacity": -1}, {"capacity": 4, "evict": "fifo"},
                                 {"capacity": 4, "admit_after": 0}])  # fmt: skip
def test_bad_settings_are_one_line(bad):
    with pytest.raises(ValueError) as e:
        DynamicSpec(**bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("evict", "admit_after"), [("lru", 1), ("lfu", 1), ("lru", 3)])
def test_the_fast_map_decides_as_its_sorting_twin(evict, admit_after):
    """Random calls, skewed ids, a full map most of the time, a few overflows."""
    slots, spread, drift = (64, 400, 30) if admit_after == 1 else (24, 100, 5)
    spec = DynamicSpec(slots, evict=evict, admit_after=admit_after)
    fast, ref = (DynamicMap(spec, slots, torch.device("cpu"), reference=r) for r in (False, True))
    g = torch.Generator().manual_seed(5)
    overflows = evictions = 0
    for call in range(200):
        n = int(torch.randint(0, 70, (), generator=g))
        ids = (torch.rand(n, generator=g) ** 3 * spread).long() - 200 + (call % 7) * drift
        a, b = fast.map(ids), ref.map(ids)
        assert a.overflow == b.overflow and a.needed == b.needed, call
        assert torch.equal(a.slots, b.slots) and torch.equal(a.new_slots, b.new_slots), call
        overflows += a.overflow
        evictions += a.evicted
        if not a.overflow:
            fast.commit(a)
            ref.commit(b)
        for k, v in ref.tensors().items():
            assert torch.equal(fast.tensors()[k], v), (call, k)
        assert all(torch.equal(x, y) for x, y in zip(fast.held(), ref.held(), strict=True))
    assert evictions > 50 and overflows < 100
    assert overflows > 0 or admit_after > 1


def _padded(comm) -> tuple:
    model = torch.nn.Sequential(torch.nn.Embedding(10, DIM, padding_idx=0))
    model.sharded_modules = ("0",)
    plan = ShardingPlan(table_dynamics={"0": DynamicSpec(16)})
    coll = swap(model, plan, comm)
    ids = torch.tensor([[0, 5, 2**40], [0, 0, 7]])
    out = model(ids)
    out.sum().backward()
    held, _, _ = coll.dynamic_rows("0")
    with torch.no_grad():
        again = model(ids)
    return out.detach(), held, again


@pytest.mark.parametrize("world", [1, 2])
def test_a_padding_id_reads_zeros_and_never_gets_a_row(world):
    for out, held, again in run_threads(_padded, world):
        assert torch.equal(out[:, 0], torch.zeros(2, DIM)) and torch.equal(again[1, :2], out[1, :2])
        assert sorted(held.tolist()) == [5, 7, 2**40]
        assert not torch.equal(again[0, 1], out[0, 1])  # id 5 was updated
