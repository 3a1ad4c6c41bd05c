"""Prioritized updates are bit-identical to the synchronous path (gloo ranks, W = 1, 2, 4).

The same sequence of global batches is trained twice per rank, synchronously
and with prioritized updates, for SGD with an lr schedule that changes every
step, row-wise Adagrad (plain and with L2 weight decay) and Adam, over batches
whose rows collide with the previous step's at a designed rate (0 %, ~5 %,
~50 %, 100 % = identical batches). Outputs, losses, tables, optimizer state
and step counters must be equal bit for bit. The schedule varies on purpose:
prefetch before and after forward, one step not prefetched (its forward runs
in place), a flush and an evaluation lookup between steps, and a last step
with nothing prefetched.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from freescale.comm import TorchCommunicator, run_threads
from freescale.embedding import Prioritized, SparseDataDist, Sync
from freescale.jagged import JaggedTensor
from freescale.testing import run_ranks
from tests.embedding._train import (
    SAMPLES,
    make_collection,
    pack,
    snapshot,
    split_sizes,
    targets,
    unpack,
)

# feature -> table; "c2" is a plain [samples, 2] tensor, the others are jagged.
FEATURES = {"uih": "items", "cand": "items", "act": "actions", "c2": "cands"}
ROWS = {"items": 97, "actions": 13, "cands": 41}
DISTINCT = {"items": 24, "actions": 5, "cands": 12}  # rows each table reads per step
RATES = (0.0, 0.05, 0.5, 1.0)
OPTIMIZERS = ("sgd", "adagrad", "adam", "adagrad_l2")
STEPS = 8
GAP = 2  # step GAP does not prefetch step GAP + 1
# At step DROP nobody looks "act" up: table "actions" then lags one step behind
# "items" in the same store (per-table lr and bias correction in one update).
DROP = 5
PLANS = {1: {}, 2: {"assignment": "block"}, 4: {"assignment": "hashed", "block_size": 3}}


# ---- data: consecutive batches sharing a designed fraction of their rows ------
def designed_batches(rate: float, steps: int = STEPS, seed: int = 5) -> list:
    """Global batches; of the rows table t reads at step i+1, ``round(rate * m)``
    were read at step i and the rest were not (``rate == 1``: identical batches)."""
    g = torch.Generator().manual_seed(seed)
    batches: list = []
    prev: dict[str, torch.Tensor] = {}
    for _ in range(steps):
        if rate == 1.0 and batches:
            batches.append(batches[-1])
            continue
        uih = torch.randint(0, 8, (SAMPLES,), generator=g)
        lengths = {
            "uih": uih,
            "act": uih,
            "cand": torch.randint(0, 4, (SAMPLES,), generator=g),
            "c2": torch.full((SAMPLES,), 2),
        }
        ids = {}
        for table in ROWS:
            feats = [f for f, t in FEATURES.items() if t == table]
            total = int(sum(lengths[f].sum() for f in feats))
            rows = _row_set(table, total, rate, prev.get(table), g)
            prev[table] = rows
            pool = torch.cat(
                [rows, rows[torch.randint(0, rows.numel(), (total - rows.numel(),), generator=g)]]
            )
            pool = pool[torch.randperm(total, generator=g)]
            sizes = [int(lengths[f].sum()) for f in feats]
            for f, piece in zip(feats, pool.split(sizes), strict=True):
                ids[f] = piece
        weights = torch.rand(SAMPLES, generator=g) + 0.5
        batches.append(({f: (lengths[f], ids[f]) for f in FEATURES}, weights))
    return batches


def _row_set(table: str, total: int, rate: float, prev, g) -> torch.Tensor:
    m = min(DISTINCT[table], total)
    if prev is None:
        return torch.randperm(ROWS[table], generator=g)[:m]
    k = min(round(rate * m), prev.numel())
    shared = prev[torch.randperm(prev.numel(), generator=g)[:k]]
    fresh = torch.ones(ROWS[table], dtype=torch.bool)
    fresh[prev] = False
    others = torch.nonzero(fresh).squeeze(1)
    return torch.cat([shared, others[torch.randperm(others.numel(), generator=g)[: m - k]]])


def local_batch(batch, step: int, rank: int, world_size: int):
    """This rank's samples of a global batch: features and per-id loss weights."""
    per_feature, weights = batch
    sizes = split_sizes(step, world_size)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    features, id_weights = {}, {}
    for f, (lengths, ids) in per_feature.items():
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        values = ids[int(offsets[lo]) : int(offsets[hi])]
        if f == "c2":
            features[f] = values.reshape(-1, 2)
        else:
            features[f] = JaggedTensor.from_lengths(values, lengths[lo:hi])
        id_weights[f] = torch.repeat_interleave(weights[lo:hi], lengths[lo:hi])
    if step == DROP:
        del features["act"], id_weights["act"]
    return features, id_weights


def values_of(x) -> torch.Tensor:
    return x.values if isinstance(x, JaggedTensor) else x.reshape(-1, x.shape[-1])


def ids_of(x) -> torch.Tensor:
    return x.values if isinstance(x, JaggedTensor) else x.reshape(-1)


def loss_of(outputs: dict, features: dict, id_weights: dict, tgt: dict) -> torch.Tensor:
    total = torch.zeros(())
    for f, emb in outputs.items():
        diff = values_of(emb) - tgt[FEATURES[f]][ids_of(features[f])]
        total = total + (id_weights[f] * 0.5 * diff.pow(2).sum(1)).sum()
    return total / SAMPLES


# ---- one training run on one rank ---------------------------------------------
def to_device(local: tuple[dict, dict], device: torch.device) -> tuple[dict, dict]:
    features, id_weights = local

    def move(x):
        if isinstance(x, JaggedTensor):
            return JaggedTensor(x.values.to(device), x.offsets.to(device))
        return x.to(device)

    return {f: move(v) for f, v in features.items()}, {f: move(w) for f, w in id_weights.items()}


def train(coll, comm, batches, prioritized: bool, first: int = 0, gap: int | None = GAP) -> dict:
    """Steps ``first..`` of ``batches``; prioritized runs prefetch step i+1 before
    forward on even steps, after it on odd ones, and skip the prefetch at ``gap``."""
    tgt = {name: t.to(comm.device) for name, t in targets().items()}
    local = [
        to_device(local_batch(b, s, comm.rank, comm.world_size), comm.device)
        for s, b in enumerate(batches)
    ]
    steps = range(first, len(batches))
    if prioritized:
        coll.prefetch(local[first][0])
    out = {"outputs": [], "losses": [], "stats": [], "eval": None}
    for step in steps:
        features, id_weights = local[step]
        ahead = prioritized and step + 1 < len(batches) and step != gap
        if ahead and step % 2 == 0:
            coll.prefetch(local[step + 1][0])
        outputs = coll(features)
        if ahead and step % 2 == 1:
            coll.prefetch(local[step + 1][0])
        stats = coll.collision_stats() if ahead else None
        out["stats"].append(None if stats is None else [int(t) for t in vars(stats).values()])
        loss = loss_of(outputs, features, id_weights, tgt)
        loss.backward()
        out["outputs"].append({f: values_of(v).detach().clone() for f, v in outputs.items()})
        out["losses"].append(loss.item())
        if step == 4:
            coll.flush()  # an early flush leaves the prefetched rows valid
            with torch.no_grad():  # an evaluation lookup between steps
                evaluated = coll(local[0][0])
            out["eval"] = {f: values_of(v).clone() for f, v in evaluated.items()}
    out["tables"] = snapshot(coll)
    return out


def _parity_rank(world_size: int) -> bytes:
    return parity_runs(TorchCommunicator(), world_size)


def parity_runs(comm, world_size: int) -> bytes:
    """Every rate x optimizer trained synchronously and prioritized, packed."""
    results = {}
    for rate in RATES:
        batches = designed_batches(rate)
        for opt in OPTIMIZERS:
            runs = {}
            for prioritized in (False, True):
                mode = Prioritized() if prioritized else Sync()
                coll = make_collection(comm, opt, PLANS[world_size], mode=mode)
                runs[prioritized] = train(coll, comm, batches, prioritized)
            results[(rate, opt)] = runs
    return pack(results)


def _expected_stats(batches) -> list[list[int]]:
    """Global (C rows, rows of i+1, C ids, ids of i+1) of each step with its next."""
    out = []
    for step, ((now, _), (nxt, _)) in enumerate(itertools.pairwise(batches)):
        c = rn = ci = n = 0
        for table in ROWS:
            none = [torch.zeros(0, dtype=torch.int64)]
            feats = [f for f, t in FEATURES.items() if t == table]
            ids_now = torch.cat(none + [now[f][1] for f in feats if (step, f) != (DROP, "act")])
            ids_next = torch.cat(
                none + [nxt[f][1] for f in feats if (step + 1, f) != (DROP, "act")]
            )
            hit = torch.isin(ids_next, ids_now)
            c += int(torch.isin(ids_next.unique(), ids_now).sum())
            rn += int(ids_next.unique().numel())
            ci, n = ci + int(hit.sum()), n + ids_next.numel()
        out.append([c, rn, ci, n])
    return out


def _assert_equal_runs(sync: dict, prio: dict) -> None:
    assert sync["losses"] == prio["losses"]
    for a, b in zip(sync["outputs"], prio["outputs"], strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[f], b[f]) for f in a)
    assert all(torch.equal(sync["eval"][f], prio["eval"][f]) for f in sync["eval"])
    for name, table in sync["tables"].items():
        other = prio["tables"][name]
        assert table["step"] == other["step"] == STEPS - (name == "actions")
        assert torch.equal(table["weight"], other["weight"]), name
        assert table["state"].keys() == other["state"].keys()
        for key, value in table["state"].items():
            assert torch.equal(value, other["state"][key]), f"{name} {key}"


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_prioritized_is_bit_identical_to_sync(world_size):
    per_rank = [unpack(r) for r in run_ranks(_parity_rank, world_size, world_size, timeout=240)]
    for rate in RATES:
        expected = _expected_stats(designed_batches(rate))
        for opt in OPTIMIZERS:
            for r in per_rank:
                _assert_equal_runs(r[(rate, opt)][False], r[(rate, opt)][True])
            # Per-rank stats (shard-major) add up to the global collision of the batches.
            for step in range(STEPS - 1):
                got = [r[(rate, opt)][True]["stats"][step] for r in per_rank]
                if step == GAP:
                    assert got == [None] * world_size
                    continue
                assert [sum(s[k] for s in got) for k in range(4)] == expected[step]
        c, rn, _, _ = (sum(s[k] for s in expected) for k in range(4))
        # The designed collision rate, up to its rounding to whole rows (half a
        # row per table and step pair) and the step that reads no actions (the
        # actions table's rows of its two step pairs).
        rows_off = 0.5 * len(ROWS) * (STEPS - 1) + 2 * DISTINCT["actions"]
        assert abs(c / rn - rate) <= rows_off / rn


# ---- checkpoint with a non-empty stash, every mode ----------------------------------
def _run(coll, comm, local, steps, tgt, prefetch: bool = True) -> list[float]:
    """Prefetch step i+1 before step i's forward (if it exists and ``prefetch``)."""
    losses = []
    for step in steps:
        if prefetch and step + 1 < len(local):
            coll.prefetch(local[step + 1][0])
        features, id_weights = local[step]
        loss = loss_of(coll(features), features, id_weights, tgt)
        loss.backward()
        losses.append(loss.item())
    return losses


def _checkpoint_rank() -> bytes:
    comm, plan, tgt = TorchCommunicator(), {"block_size": 2}, targets()
    batches = designed_batches(0.5, steps=10)
    local = [local_batch(b, s, comm.rank, comm.world_size) for s, b in enumerate(batches)]

    def fresh(seed: int = 0):
        return make_collection(comm, "adam", plan, seed=seed, mode=Prioritized())

    uninterrupted = fresh()
    uninterrupted.prefetch(local[0][0])
    expected = _run(uninterrupted, comm, local, range(10), tgt)
    # Stop after step 4: step 5 is prefetched, X^4 is stashed.
    first = fresh()
    first.prefetch(local[0][0])
    losses = _run(first, comm, local, range(5), tgt)
    stashed = sum(d.slots.numel() for d in first.mode.schedule.stash)
    first.flush()
    state = {k: v.clone() for k, v in first.state_dict().items()}
    resumed = fresh(seed=7)
    resumed.set_table("items", torch.zeros(97, 8))
    resumed.load_state_dict(state)
    resumed.prefetch(local[5][0])
    resumed_losses = losses + _run(resumed, comm, local, range(5, 10), tgt)
    continued_losses = losses + _run(first, comm, local, range(5, 10), tgt)  # after the flush
    # The same run in sync mode (no prefetch) and with sdd's prefetch.
    sync = make_collection(comm, "adam", plan)
    sync_losses = _run(sync, comm, local, range(10), tgt, prefetch=False)
    sdd = make_collection(comm, "adam", plan, mode=SparseDataDist())
    sdd.prefetch(local[0][0])
    sdd_losses = _run(sdd, comm, local, range(10), tgt)
    runs = {
        name: {"losses": ls, "tables": snapshot(c)}
        for name, ls, c in (
            ("uninterrupted", expected, uninterrupted),
            ("resumed", resumed_losses, resumed),
            ("continued", continued_losses, first),
            ("sync", sync_losses, sync),
            ("sdd", sdd_losses, sdd),
        )
    }
    return pack({"runs": runs, "stashed": stashed})


def test_checkpoint_with_a_stash_and_every_mode_are_bit_identical():
    per_rank = [unpack(r) for r in run_ranks(_checkpoint_rank, 2, timeout=120)]
    assert sum(r["stashed"] for r in per_rank) > 0  # the checkpoint had a deferred update
    for r in per_rank:
        want = r["runs"]["uninterrupted"]
        for name in ("resumed", "continued", "sync", "sdd"):
            got = r["runs"][name]
            assert got["losses"] == want["losses"], name
            for table, t in want["tables"].items():
                assert got["tables"][table]["step"] == t["step"] == 10 - (table == "actions")
                assert torch.equal(got["tables"][table]["weight"], t["weight"]), name
                for key, value in t["state"].items():
                    assert torch.equal(got["tables"][table]["state"][key], value), name


# ---- misuse fails loudly ---------------------------------------------------------
def _misuse(comm) -> list[str]:
    coll = make_collection(comm, "sgd", {}, mode=Prioritized())
    local = [
        local_batch(b, s, comm.rank, comm.world_size)
        for s, b in enumerate(designed_batches(0.5, 3))
    ]
    errors = []
    coll.prefetch(local[0][0])
    coll.prefetch(local[1][0])
    for attempt in (
        lambda: coll.prefetch(local[2][0]),  # two steps ahead
        lambda: coll(local[1][0]),  # not the prefetched call
    ):
        try:
            attempt()
        except RuntimeError as e:
            errors.append(str(e))
    out = coll(local[0][0])
    try:
        coll(local[1][0])  # a second forward before backward
    except RuntimeError as e:
        errors.append(str(e))
    with coll.prefetch_disabled():
        try:
            coll(local[1][0])  # a training lookup outside the schedule
        except RuntimeError as e:
            errors.append(str(e))
    loss = sum(values_of(v).sum() for v in out.values())
    loss.backward()
    return errors


def test_misuse_raises_on_every_rank():
    for errors in run_threads(_misuse, 2):
        assert len(errors) == 4
        assert "at most one step ahead" in errors[0]
        assert "does not match" in errors[1]
        assert "backpropagate through it before the next forward" in errors[2]
        assert "torch.no_grad()" in errors[3]
