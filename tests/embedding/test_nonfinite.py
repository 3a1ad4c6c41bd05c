"""A step with a non-finite loss or gradient on any rank changes nothing, anywhere.

The guard's decision is taken on the device inside backward (the update is
fused there). A run whose step BAD is poisoned on one rank must end with the
tables, optimizer state and step counters of a clean run that never had step
BAD, bit for bit, in the synchronous and prioritized paths, for SGD with an lr
schedule, row-wise Adagrad and Adam (whose bias correction counts steps).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from freescale.comm import TorchCommunicator
from freescale.embedding import Prioritized, SparseDataDist
from freescale.jagged import JaggedTensor
from freescale.testing import run_ranks
from tests.embedding._train import make_collection, snapshot, targets
from tests.embedding.test_prioritized import (
    PLANS,
    designed_batches,
    local_batch,
    loss_of,
    to_device,
)

BAD, BAD_RANK, STEPS = 2, 1, 7  # at step 2 the other rank has no samples
POISONS = ("loss", "gradient")


def _train(comm, opt: str, prioritized: bool, steps: list[int], poison: str | None) -> dict:
    bad_rank = min(BAD_RANK, comm.world_size - 1)
    batches = designed_batches(0.5, steps=STEPS)
    mode = Prioritized() if prioritized else SparseDataDist()
    coll = make_collection(comm, opt, PLANS[comm.world_size], mode=mode)
    guard = coll.guard_nonfinite()
    tgt = {name: t.to(comm.device) for name, t in targets().items()}
    local = {s: to_device(local_batch(batches[s], s, comm.rank, comm.world_size), comm.device)
             for s in steps}  # fmt: skip
    flags, losses = [], []
    if prioritized:
        coll.prefetch(local[steps[0]][0])
    for i, step in enumerate(steps):
        if prioritized and i + 1 < len(steps):
            coll.prefetch(local[steps[i + 1]][0])
        features, id_weights = local[step]
        outputs = coll(features)
        bad_here = poison and step == BAD and comm.rank == bad_rank
        if bad_here and poison == "gradient":  # a finite loss, Inf gradients
            for out in outputs.values():
                emb = out.values if isinstance(out, JaggedTensor) else out
                emb.register_hook(lambda g: g + float("inf"))
        loss = loss_of(outputs, features, id_weights, tgt)
        if bad_here and poison == "loss":
            loss = loss * float("nan")
        guard.begin_step(loss)
        loss.backward()
        flags.append(bool(guard.step_flag()))
        losses.append(loss.item())
    return {"tables": snapshot(coll), "flags": flags, "losses": losses}


def _rank(world_size: int, opt: str, prioritized: bool, device: str = "cpu") -> dict:
    comm = TorchCommunicator()
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
        comm = TorchCommunicator(group=dist.new_group(backend="nccl"), device="cuda")
    clean = [s for s in range(STEPS) if s != BAD]
    out = {"clean": _train(comm, opt, prioritized, clean, None)}
    for poison in POISONS:
        out[poison] = _train(comm, opt, prioritized, list(range(STEPS)), poison)
    return out


@pytest.mark.parametrize("prioritized", [False, True], ids=["sync", "prioritized"])
@pytest.mark.parametrize("opt", ["sgd", "adagrad", "adam"])
def test_a_poisoned_step_changes_nothing_on_any_rank(opt, prioritized):
    _check(run_ranks(_rank, 2, 2, opt, prioritized, timeout=240))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("prioritized", [False, True], ids=["sync", "prioritized"])
def test_a_poisoned_step_changes_nothing_on_cuda(prioritized):
    """The Triton update and NCCL: the flag is read on the device only."""
    world_size = 2 if torch.cuda.device_count() >= 2 else 1
    _check(run_ranks(_rank, world_size, world_size, "adam", prioritized, "cuda", timeout=300))


def _check(per_rank: list[dict]) -> None:
    for r in per_rank:
        for poison in POISONS:
            run, clean = r[poison], r["clean"]
            # every rank agrees: only step BAD is flagged, here too when it was finite
            assert run["flags"] == [s == BAD for s in range(STEPS)], poison
            # the steps after the skipped one see exactly the clean run's tables
            after = [x for s, x in enumerate(run["losses"]) if s != BAD]
            assert after == clean["losses"], poison
            for name, table in clean["tables"].items():
                got = run["tables"][name]
                assert got["step"] == table["step"], (poison, name)
                assert torch.equal(got["weight"], table["weight"]), (poison, name)
                for key, value in table["state"].items():
                    assert torch.equal(got["state"][key], value), (poison, name, key)


def _unguarded_rank(world_size: int) -> bool:
    comm = TorchCommunicator()
    batches = designed_batches(0.5, steps=2)
    coll = make_collection(comm, "adagrad", PLANS[world_size])
    tgt = {name: t.to(comm.device) for name, t in targets().items()}
    features, id_weights = to_device(local_batch(batches[0], 0, comm.rank, 2), comm.device)
    loss = loss_of(coll(features), features, id_weights, tgt)
    (loss * (float("nan") if comm.rank == BAD_RANK else 1.0)).backward()
    return bool(torch.isnan(coll.full_table("items")).any())


def test_without_the_guard_a_nan_reaches_the_tables():
    """The failure the guard prevents (so the test above can fail)."""
    assert run_ranks(_unguarded_rank, 2, 2, timeout=120) == [True, True]
