"""Training with load balancing on vs off: same math up to float reassociation.

Balancing moves samples between ranks (and reorders them) within a global
step. The loss is normalized by the global candidate count and dense
gradients are summed over ranks, so the update is the same function of the
global batch; only the order of floating-point additions changes (per-rank
partial sums of the loss/gradients, the arrival order of duplicate embedding
rows). Hence equality up to a small relative tolerance, not bit equality.
"""

import json
from unittest import mock

import pytest
import torch

from freescale.config import build_config
from freescale.pipeline.balancing import BalanceStage
from freescale.pipeline.train import Trainer
from freescale.run.launch import launch
from freescale.testing import run_ranks
from freescale.testing.tolerance import adam_drift, steps_tol
from tests.models.test_layout_once import BLOCK_DEPTH

STEPS = 10


def _train(balance: str, mode: str, *extra: str) -> dict:
    cfg = [f"run.steps={STEPS}", "run.warmup=1", "evaluation.every=0", "output.progress=false",
           f"balance={balance}", f"run.mode={mode}", *extra]  # fmt: skip
    trainer = Trainer(build_config("demo", cfg))
    local: list[int] = []  # this rank's balanced batch sizes
    counts: list[torch.Tensor] = []  # this rank's reads of each item row, per step
    flops: list[tuple] = []  # (the balancer's count from the sizes, the model's on the batch)
    pop = BalanceStage.pop

    def recording_pop(stage):
        out = pop(stage)
        local.append(out[0].batch_size)
        flops.append((out[1].flops, trainer.model.flops(out[0])))
        ids = trainer.model.embedding_inputs(out[0])["item_emb"]
        counts.append(torch.bincount(ids.cpu(), minlength=trainer.cfg.data.num_items))
        return out

    with mock.patch.object(BalanceStage, "pop", recording_pop):
        trainer.run()
    return {
        "local": local,
        "counts": counts,
        "cfg": trainer.cfg,
        "losses": [s["loss"] for s in trainer.summary.steps],
        "samples": [s["samples"] for s in trainer.summary.steps],
        "step_tflop": [s["step_tflop"] for s in trainer.summary.steps],
        "flops": flops,
        "table": trainer.embeddings.full_table("item_emb"),
        "dense": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
    }


def _run(world: int, *args: str) -> dict:
    """Rank 0's result, with ``hot``: the most reads of one item row in a
    global step (the longest sum of a table gradient), when balanced (the
    balancer's stage is where the batches are seen)."""
    ranks = run_ranks(_train, world, *args, timeout=300)
    steps = zip(*(r["counts"] for r in ranks), strict=True)
    hot = max((int(sum(c).max()) for c in steps), default=None)
    return {**ranks[0], "hot": hot, "ranks": ranks}


@pytest.fixture(scope="module")
def baseline():
    return _run(2, "none", "sync")


@pytest.mark.parametrize(
    "balance,mode",
    [("fbs", "sync"), pytest.param("cost", "sdd", marks=pytest.mark.numeric), ("vbs", "sync")],
)
def test_balanced_training_matches_unbalanced(baseline, balance, mode):
    _assert_same_run(_run(2, balance, mode), baseline)


@pytest.mark.slow  # fast twins: the 2-rank cases above (every balancer and mode)
def test_balanced_training_matches_unbalanced_at_four_ranks():
    _assert_same_run(_run(4, "cost", "sync"), _run(4, "none", "sync"))


# Heavier-tailed lengths than the demo's, so that the cost partitioner does
# give ranks different counts (with the demo lengths equal counts win).
TAIL = ("data.length_median=3", "data.length_sigma=1.5")
VARIABLE = ("balance.counts=variable",)


@pytest.fixture(scope="module")
def tail_baseline():
    return _run(2, "none", "sync", *TAIL)


@pytest.mark.parametrize("mode", ["sync", "sdd"])
def test_variable_counts_match_unbalanced_and_really_vary(tail_baseline, mode):
    """Cost partitioner with variable local batch sizes (capped at 2 x batch):
    same math as unbalanced, and the local batches did differ in size."""
    got = _run(2, "cost", mode, *TAIL, *VARIABLE)
    _assert_uneven([r["local"] for r in got["ranks"]], cap=2 * 32)  # demo batch_size = 32
    _assert_same_run(got, tail_baseline)


@pytest.mark.slow
def test_variable_counts_match_unbalanced_at_four_ranks():
    base = _run(4, "none", "sync", *TAIL)
    got = _run(4, "cost", "sync", *TAIL, *VARIABLE, "balance.max_local_batch=40")
    _assert_uneven([r["local"] for r in got["ranks"]], cap=40)
    _assert_same_run(got, base)


def _assert_uneven(sizes: list[list[int]], cap: int) -> None:
    assert all(0 < b <= cap for s in sizes for b in s)
    assert any(len(set(step)) > 1 for step in zip(*sizes, strict=True))


def _assert_same_run(got: dict, base: dict) -> None:
    """Same samples; the rest up to reordered sums over `STEPS` steps.

    A step chains a forward and a backward through the blocks and the head;
    its sums run over features, keys, and, for an item row's gradient, its
    reads (``hot`` at most). The loss is a mean of positive BCE terms
    (relative); a row-wise Adagrad step is at most ``lr·sqrt(dim)``, with the
    gradient's relative error ``sqrt(n)`` times a sum's (terms of either
    sign) and the optimizer's doubling it; the dense weights use Adam, whose
    step where the gradient is rounding noise (the attention's key bias: its
    exact gradient is zero) can take either sign (`adam_drift`)."""
    cfg, hot = base["cfg"], got["hot"]  # the same global batches: the same reads
    assert got["samples"] == base["samples"]  # nothing lost or duplicated
    # FLOPs: each balanced batch's, counted on the helper thread from its sizes, is
    # the model's count of that batch; a step's (all ranks) is the unbalanced one's
    assert got["flops"] and all(a == b for r in got["ranks"] for a, b in r["flops"])
    assert got["step_tflop"] == base["step_tflop"]
    dim, layers = cfg.model.options["dim"], cfg.model.options["layers"]
    depth = 2 * BLOCK_DEPTH * layers + 2
    keys = cfg.data.max_uih + cfg.data.max_candidates
    terms = max(2 * dim, keys, hot)
    losses, want = torch.tensor(got["losses"]), torch.tensor(base["losses"])
    loss_tol = steps_tol(torch.float32, terms, float(want.abs().max()), STEPS, depth)
    torch.testing.assert_close(losses, want, **loss_tol)
    step = cfg.embeddings.lr * dim**0.5 * hot**0.5
    table_tol = steps_tol(torch.float32, terms, step, STEPS, depth + 2)
    torch.testing.assert_close(got["table"], base["table"], **table_tol)
    for k, v in base["dense"].items():
        torch.testing.assert_close(got["dense"][k], v, rtol=0, atol=adam_drift(cfg.dense.lr, STEPS))


def _losses(tmp_path, plan_process: str) -> list[float]:
    path = tmp_path / f"{plan_process}.jsonl"
    cfg = ["run.steps=10", "run.warmup=1", "evaluation.every=0", "output.progress=false",
           "balance=fbs",
           f"balance.plan_process={plan_process}", f"output.metrics_path={path}"]  # fmt: skip
    launch(build_config("demo", cfg))  # spawned ranks: run_ranks' daemons can't fork
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_planning_in_a_helper_process_gives_the_same_run(tmp_path):
    """The partitioner in its own process (off the trainer's GIL) plans exactly
    as in the balancer's thread: FBS depends on the lengths only."""
    assert _losses(tmp_path, "on") == _losses(tmp_path, "off")
