"""Tables on the host tier train bit-identically to tables on the device.

The same designed batches (collision rates 0 %, ~50 %, 100 %) are trained
with the ``items`` table placed on the device and on the host (its store then
splits from ``actions``, with which it shares dim and optimizer), in every
mode x optimizer: outputs, losses, tables, optimizer state and step counters
must be equal bit for bit. The loop is the trainer's: prefetch step i+1
before forward i, ``prefetch_ids`` after it (sdd stages the host rows there,
and step i's update must refresh the staged rows it writes), an evaluation
lookup and a flush mid-run, a step the non-finite guard skips. Threads as ranks (W = 1,
2 by default; 4 and the full cross product are slow).
"""

from __future__ import annotations

import pytest
import torch

from freescale.comm import run_threads
from freescale.embedding import (
    Prioritized,
    ShardedEmbeddingCollection,
    SparseDataDist,
    Sync,
    TableConfig,
)
from freescale.embedding.config import ShardingPlan
from freescale.embedding.host_tier import HostTier, check_host_memory
from freescale.kernels.host_rows import gather_host_rows, refresh_host_rows
from tests.embedding._train import make_collection, snapshot, targets
from tests.embedding.test_prioritized import (
    OPTIMIZERS,
    PLANS,
    designed_batches,
    local_batch,
    loss_of,
    values_of,
)

MODES = {"sync": Sync, "sdd": SparseDataDist, "freescale": Prioritized}
STEPS = 6


def _train(comm, rate: float, optimizer: str, mode: str, placement: str) -> dict:
    plan = {**PLANS[comm.world_size], "table_placements": {"items": placement}}
    coll = make_collection(comm, optimizer, plan, mode=MODES[mode]())
    coll.guard_nonfinite()
    tgt = targets()
    batches = designed_batches(rate, steps=STEPS)
    local = [local_batch(b, s, comm.rank, comm.world_size) for s, b in enumerate(batches)]
    prefetching = coll.mode.prefetches
    if prefetching:
        coll.prefetch(local[0][0])
    out: dict = {"losses": [], "outputs": []}
    for step, (features, id_weights) in enumerate(local):
        if prefetching and step + 1 < STEPS:
            coll.prefetch(local[step + 1][0])
        out_by_group = coll(features)
        coll.prefetch_ids()
        # In feature order: a host table has its own store, so the groups (and
        # the dict's order, which the loss would sum in) differ from the device run.
        outputs = {f: out_by_group[f] for f in sorted(out_by_group)}
        loss = loss_of(outputs, features, id_weights, tgt)
        bad = step == 3 and comm.rank == 0  # evidence of one rank: every rank skips step 3
        coll.nonfinite.begin_step(torch.tensor(float("nan") if bad else 0.0))
        loss.backward()
        out["losses"].append(loss.item())
        out["outputs"].append({f: values_of(v).detach().clone() for f, v in outputs.items()})
        if step == 2:
            coll.flush()
            with coll.prefetch_disabled(), torch.no_grad():  # an evaluation between steps
                out["eval"] = {f: values_of(v) for f, v in coll(local[0][0]).items()}
    out["tables"] = snapshot(coll)
    out["host_bytes"] = int(t.sum()) if (t := coll.host_tier_traffic()) is not None else None
    return out


def _assert_same(device: dict, host: dict) -> None:
    assert device["losses"] == host["losses"]
    for a, b in zip(device["outputs"], host["outputs"], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[f], b[f]) for f in a)
    assert all(torch.equal(device["eval"][f], host["eval"][f]) for f in device["eval"])
    for name, table in device["tables"].items():
        other = host["tables"][name]
        assert table["step"] == other["step"]
        assert torch.equal(table["weight"], other["weight"]), name
        for key, value in table["state"].items():
            assert torch.equal(value, other["state"][key]), (name, key)


def _check(world_size: int, rates, optimizers, modes) -> None:
    for rate in rates:
        for opt in optimizers:
            for mode in modes:
                device = run_threads(_train, world_size, rate, opt, mode, "device")
                host = run_threads(_train, world_size, rate, opt, mode, "host")
                for d, h in zip(device, host, strict=True):
                    _assert_same(d, h)
                    assert d["host_bytes"] is None and h["host_bytes"] > 0
                    assert h["tables"]["items"]["step"] == STEPS - 1  # the skipped step


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_host_table_trains_bit_identically_in_every_mode(world_size, mode):
    _check(world_size, (0.5,), ("sgd", "adagrad", "adam"), (mode,))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_rate_optimizer_and_mode_on_the_host_tier(world_size):
    _check(world_size, (0.0, 0.5, 1.0), OPTIMIZERS, list(MODES))


# ---- the tier's parts ----------------------------------------------------------------
def test_a_staged_buffer_stays_equal_to_a_fresh_gather_through_updates():
    """The invariant the sdd prefetch rests on, and what breaks without a refresh."""
    host = torch.arange(40.0).reshape(10, 4)
    tier = HostTier(torch.device("cpu"), row_bytes=16)
    slots = torch.tensor([3, 1, 3, 7])
    tier.stage(host, slots)
    host[torch.tensor([3, 5])] += 100.0  # an update of rows 3 and 5
    tier.refresh(host, torch.tensor([5, 3, 3]))
    assert torch.equal(tier.gather(host, slots), host[slots])
    assert tier.staged is None  # taken by its lookup
    assert int(tier.take_bytes()) == 16 * (4 + 2)  # the gather, the refreshed rows
    tier.drop()  # (forgets the last lookup too: nothing deferred below)
    tier.stage(host, slots)
    host[1] = -1.0
    assert not torch.equal(tier.gather(host, slots), host[slots])  # written, not refreshed


def test_rows_the_last_lookup_read_are_deferred_to_its_update():
    """sdd stages step i+1 before step i's update: rows step i read cross PCIe
    once, after that update, not once ahead and again behind it."""
    host = torch.arange(40.0).reshape(10, 4)
    tier = HostTier(torch.device("cpu"), row_bytes=16)
    now, nxt = torch.tensor([3, 1, 3, 7]), torch.tensor([1, 2, 7, 9, 2])
    tier.gather(host, now)  # step i's lookup
    tier.take_bytes()
    tier.stage(host, nxt)  # step i+1's rows: 2, 9, 2 now; 1 and 7 after the update
    assert tier.staged is not None and tier.staged.pending.tolist() == [1, 0, 1, 0, 0]
    assert int(tier.take_bytes()) == 16 * 3
    host[now] += 100.0  # step i's update...
    tier.refresh(host, now)  # ...reads the deferred rows behind it
    assert int(tier.take_bytes()) == 16 * 2
    assert torch.equal(tier.gather(host, nxt), host[nxt])
    tier.stage(host, now)  # step i+2's rows, no update before its lookup (an evaluation)
    assert tier.staged.pending.tolist() == [0, 1, 0, 1]  # rows 1, 7: step i+1 read them
    host[1] = -5.0  # read at the lookup (nothing refreshed them): it sees this
    assert torch.equal(tier.gather(host, now), host[now]) and tier.staged is None


def test_host_row_twins_move_rows_exactly():
    host = torch.randn(9, 3).to(torch.bfloat16)
    index = torch.tensor([8, 0, 0, 4])
    assert torch.equal(gather_host_rows(host, index, torch.device("cpu")), host[index])
    out = torch.zeros(4, 3, dtype=torch.bfloat16)
    refresh_host_rows(host, index, torch.tensor([True, False, True, False]), out)
    assert torch.equal(out[0], host[8]) and torch.equal(out[2], host[0])
    assert not out[1].any() and not out[3].any()


def test_bad_placements_and_too_little_host_memory_fail_in_one_line():
    with pytest.raises(ValueError, match=r"placement must be one of \('device', 'host'\)"):
        TableConfig("t", 4, 2, placement="disk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="table 'x': placement"):
        ShardingPlan(table_placements={"x": "gpu"})  # type: ignore[dict-item]
    with pytest.raises(ValueError) as e:
        check_host_memory(3 * 2**30, ranks_on_host=2, available=4 * 2**30)
    assert "\n" not in str(e.value)
    assert "need 6.00 GiB" in str(e.value) and "4.00 GiB available" in str(e.value)
    check_host_memory(2**30, ranks_on_host=2, available=4 * 2**30)  # fits: no error


def _too_big(comm) -> str:
    table = TableConfig("big", 1 << 40, 64, placement="host")  # 256 TiB / W of rows
    try:
        ShardedEmbeddingCollection([table], comm)
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_host_tier_larger_than_host_memory_fails_on_every_rank_before_allocating():
    messages = run_threads(_too_big, 2)
    # (the available memory is each rank's own reading of the moment)
    needed = {m.partition(" GiB available")[0].rsplit(", ", 1)[0] for m in messages}
    assert len(needed) == 1 and messages[0].startswith("host-tier tables need")
