"""A dynamic table's state entries (`TableEntries`), from the user's side.

Below capacity (evictions every step), a run whose entries are taken at a step
boundary and loaded into a fresh collection of the same world size continues
bit for bit like the uninterrupted run, in every mode: losses, every slot's
row and optimizer state, the map (ids, last use, use count, pending ids, call
counter). At another world size each held id goes to its new owner with its
row, state and counts; where a shard gets more ids than slots, those its
policy evicts first are dropped, counted, in one stderr line.
"""

from __future__ import annotations

import math

import pytest
import torch

from freescale.comm import run_threads
from freescale.embedding import ShardedEmbeddingCollection, ShardingPlan, TableConfig, TableEntries
from freescale.embedding.dynamic import DynamicSpec, owner_of
from freescale.embedding.state.dynamic_entries import rows_by_id
from freescale.embedding.state.state_dict import load_tables, save_tables
from freescale.jagged import JaggedTensor
from tests.embedding.test_dynamic import DIM, MODES, OPTIMIZERS, SEED, raw_map

ROWS, SAMPLES, STEPS, AT = 600, 12, 9, 5  # ids, samples a step, steps, entries taken before AT


def batch(step: int, rank: int, world: int) -> tuple[JaggedTensor, torch.Tensor]:
    """This rank's part of a global batch of about 90 ids, many new at each step."""
    g = torch.Generator().manual_seed(300 + step)
    lengths = torch.randint(0, 16, (SAMPLES,), generator=g)
    ids = (torch.rand(int(lengths.sum()), generator=g) ** 1.5 * ROWS).long()
    target = torch.randn(int(lengths.sum()), DIM, generator=g)
    lo, hi = SAMPLES * rank // world, SAMPLES * (rank + 1) // world
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    a, b = int(offsets[lo]), int(offsets[hi])
    return JaggedTensor.from_lengths(ids[a:b], lengths[lo:hi]), target[a:b]


class Run:
    """One rank's collection trained as the trainer does: step i+1 is
    prefetched before step i's forward (a prefetching mode maps it then)."""

    def __init__(self, comm, mode: str, spec: DynamicSpec, placement: str = "device") -> None:
        self.comm, self.raw = comm, raw_map(ROWS)
        table = TableConfig("items", ROWS, DIM, optimizer=OPTIMIZERS["adam"](), dynamic=spec,
                            placement=placement)  # fmt: skip
        self.coll = ShardedEmbeddingCollection(
            [table], comm, ShardingPlan(), device=comm.device, seed=SEED, mode=MODES[mode]()
        )

    def features(self, step: int) -> dict:
        ids, _ = batch(step, self.comm.rank, self.comm.world_size)
        return {"items": JaggedTensor(self.raw[ids.values], ids.offsets)}

    def train(self, first: int, end: int, take_at: int | None = None) -> tuple[list, dict | None]:
        """Losses of steps ``[first, end)``; the entries at ``take_at`` (before that step)."""
        coll, taken = self.coll, None
        prefetches = coll.mode.prefetches
        if prefetches:
            coll.prefetch(self.features(first))
        losses = []
        for step in range(first, end):
            if step == take_at:
                taken = {k: v.clone() for k, v in TableEntries(coll).state_dict().items()}
            if prefetches and step + 1 < end:
                coll.prefetch(self.features(step + 1))
            out = coll(self.features(step))["items"].values
            if prefetches:
                coll.prefetch_ids()
            target = batch(step, self.comm.rank, self.comm.world_size)[1]
            loss = 0.5 * (out - target).pow(2).sum() / SAMPLES
            loss.backward()
            losses.append(loss.item())
        coll.flush()
        return losses, taken

    def state(self) -> dict:
        """Every slot of this rank, the map, and the table by id (a collective)."""
        store = self.coll.stores[0]
        ids, rows, opt = self.coll.dynamic_rows("items")
        return {
            "slots": {"weight": store.weight.clone(), **{k: v.clone() for k, v in
                      {**store.optimizer_state(), **store.dynamic.map.tensors()}.items()}},
            "by_id": (ids, rows, opt),
            "step": self.coll.step_of("items"),
        }  # fmt: skip


def _same_world(comm, mode: str, spec: DynamicSpec, placement: str) -> dict:
    full = Run(comm, mode, spec, placement)
    losses, taken = full.train(0, STEPS, take_at=AT)
    resumed = Run(comm, mode, spec, placement)
    resumed.coll.stores[0].weight.normal_()  # nothing of a fresh collection may survive
    TableEntries(resumed.coll).load_state_dict(taken)
    resumed_losses = resumed.train(AT, STEPS)[0]
    return {"full": full.state(), "resumed": resumed.state(), "losses": losses,
            "resumed_losses": resumed_losses, "counts": full.coll.dynamic_counts()}  # fmt: skip


def _full_losses(comm, mode: str, spec: DynamicSpec, placement: str) -> list:
    return Run(comm, mode, spec, placement).train(0, STEPS)[0]


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize(
    ("world", "spec", "placement"),
    [
        (2, DynamicSpec(150), "device"),
        (2, DynamicSpec(150), "host"),
        (3, DynamicSpec(70, evict="lfu", admit_after=2), "device"),
    ],
)
def test_entries_taken_and_loaded_at_the_same_world_size_continue_bit_for_bit(
    mode, world, spec, placement
):
    runs = run_threads(_same_world, world, mode, spec, placement)
    expected = run_threads(_full_losses, world, mode, spec, placement)
    assert sum(r["counts"][3] for r in runs) > 20  # evictions happened
    for run, want in zip(runs, expected, strict=True):
        assert run["losses"] == want, mode  # taking the entries changed nothing
        assert run["resumed_losses"] == want[AT:], mode
        full, resumed = run["full"], run["resumed"]
        assert full["step"] == resumed["step"] == STEPS
        assert full["slots"].keys() == resumed["slots"].keys()
        for key, value in full["slots"].items():  # slot for slot, the map included
            assert torch.equal(value, resumed["slots"][key]), (mode, key)
        for a, b in zip(full["by_id"][:2], resumed["by_id"][:2], strict=True):
            assert torch.equal(a, b), mode


def _taken(comm, spec: DynamicSpec) -> dict:
    """The entries before step ``AT`` (which the `freescale` mode has mapped already)."""
    return Run(comm, "freescale", spec).train(0, AT + 1, take_at=AT)[1]


def _reshard(comm, taken: dict, spec: DynamicSpec) -> dict:
    run = Run(comm, "sync", spec)
    TableEntries(run.coll).load_state_dict(taken)
    store = run.coll.stores[0]
    loaded = {k: v.clone() for k, v in store.dynamic.map.tensors().items()}
    by_id = run.coll.dynamic_rows("items")
    losses = run.train(AT, STEPS)[0]
    return {"map": loaded, "by_id": by_id, "slots": store.slots, "losses": losses,
            "step": run.coll.step_of("items")}  # fmt: skip


def _by_id(taken: dict, held: str, ids: str, *names: str) -> dict[int, tuple]:
    """{id: its values of ``names``} of the saved entries where ``held`` is true."""
    rows = taken[f"items.{held}"].nonzero().flatten().tolist()
    return {int(taken[f"items.{ids}"][i]): tuple(taken[f"items.{n}"][i] for n in names)
            for i in rows}  # fmt: skip


def _kept(saved: dict[int, tuple], rank: int, world: int, room: int) -> list[int]:
    """The ids of ``saved`` rank ``rank`` keeps: those it owns now, the ``room``
    used last (``saved[id][0]``: last use or sighting; ties: the larger id), by id."""
    mine = [i for i in saved if int(owner_of(torch.tensor([i]), world)) == rank]
    by_use = sorted(mine, key=lambda i: (int(saved[i][0]), i))
    return sorted(by_use[max(0, len(mine) - room) :])


HELD = ("dynamic.last_used", "dynamic.uses", "weight", "optimizer.exp_avg",
        "optimizer.exp_avg_sq")  # fmt: skip


@pytest.mark.parametrize(("saved_w", "world", "admit_after"), [(2, 3, 2), (4, 2, 1)])
def test_entries_load_at_another_world_size_by_id(saved_w, world, admit_after, capsys):
    """2 -> 3: held and pending ids on their new owners; 4 -> 2: 4 x 62 slots
    held, 2 x 110 now, so some ids are dropped, counted in one line."""
    spec = DynamicSpec(150, admit_after=admit_after)
    taken = run_threads(_taken, saved_w, spec)[0]
    held = _by_id(taken, "dynamic.occupied", "dynamic.slot_ids", *HELD)
    waiting = _by_id(taken, "dynamic.pend_seen", "dynamic.pend_ids", "dynamic.pend_last",
                     "dynamic.pend_count")  # fmt: skip
    ids, rows, state = rows_by_id(taken, "items.")  # the entries by id
    assert ids.tolist() == sorted(held)
    for n, i in enumerate(ids.tolist()):
        assert torch.equal(rows[n], held[i][2]) and torch.equal(state["exp_avg"][n], held[i][3])
    runs = run_threads(_reshard, world, taken, spec)
    err = capsys.readouterr().err
    kept = 0
    for rank, run in enumerate(runs):
        m, (ids, rows, state) = run["map"], run["by_id"]
        want = _kept(held, rank, world, run["slots"])  # slots 0, 1, ... in id order
        assert m["slot_ids"][m["occupied"]].tolist() == want
        assert not m["occupied"][len(want) :].any()
        for slot, i in enumerate(want):
            last, uses, row, exp_avg, exp_avg_sq = held[i]
            assert (int(m["last_used"][slot]), int(m["uses"][slot])) == (int(last), int(uses))
            at = int((ids == i).nonzero())
            assert torch.equal(rows[at], row)
            assert torch.equal(state["exp_avg"][at], exp_avg)
            assert torch.equal(state["exp_avg_sq"][at], exp_avg_sq)
        pending = _kept(waiting, rank, world, run["slots"])
        assert m["pend_ids"][m["pend_seen"]].tolist() == pending
        for entry, i in enumerate(pending):
            assert int(m["pend_last"][entry]) == int(waiting[i][0])
            assert int(m["pend_count"][entry]) == int(waiting[i][1])
        kept += len(want)
        assert int(m["calls"]) == int(taken["items.dynamic.calls"])
        assert run["step"] == STEPS and all(math.isfinite(x) for x in run["losses"])
    dropped = len(held) - kept
    lines = [ln for ln in err.splitlines() if "dynamic table 'items'" in ln]
    assert lines == ([f"freescale: dynamic table 'items' saved by {saved_w} ranks, loaded by "
                      f"{world} of {runs[0]['slots']} slots each: {dropped} of its {len(held)} "
                      "ids did not fit their new shard and were dropped (the least recently/"
                      "frequently used, as the table evicts)"] if dropped else [])  # fmt: skip
    assert dropped > 0 if saved_w > world else len(waiting) > 0


def _optimizer_only(comm, taken: dict, spec: DynamicSpec) -> tuple[dict, dict]:
    """Rows and map from ``taken``, then the optimizer state alone (as a fused
    optimizer's ``state_dict`` holds it) over zeroed state: by id."""
    run = Run(comm, "sync", spec)
    TableEntries(run.coll).load_state_dict(taken)
    want = run.coll.dynamic_rows("items")[2]
    state: dict = {}
    entries = TableEntries(run.coll)
    save_tables(run.coll, entries.names, "", state, weights=False)
    for t in run.coll.stores[0].optimizer_state().values():
        t.zero_()
    errors: tuple[list, list, list] = ([], [], [])
    load_tables(run.coll, entries.names, "", state, {}, True, *errors, weights=False)
    assert errors == ([], [], []), errors
    return want, run.coll.dynamic_rows("items")[2]


def test_optimizer_state_alone_loads_by_id():
    spec = DynamicSpec(150)
    taken = run_threads(_taken, 2, spec)[0]
    for want, got in run_threads(_optimizer_only, 3, taken, spec):
        assert want.keys() == got.keys() == {"exp_avg", "exp_avg_sq"}
        for k in want:
            assert torch.equal(want[k], got[k]) and bool(want[k].abs().sum() > 0), k
