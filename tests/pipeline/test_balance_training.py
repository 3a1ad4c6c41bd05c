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

from freescale.pipeline.balancing import BalanceStage
from freescale.pipeline.config import build_config
from freescale.pipeline.launch import launch
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks

# 10 steps of fp32 reassociation noise (~1e-7 per op) stay far below this.
RTOL, ATOL = 1e-4, 1e-6
# Dense weights use Adam, whose step is ~lr * sign(g) where g is tiny: there the
# noise flips/rescales whole steps. Allow a third of one step (lr = 3e-3); a real
# error (a lost sample, a wrong normalization) also breaks the tight checks above.
DENSE_ATOL = 1e-3
# Such a flipped dense step moves the gradient of one embedding dimension for
# every row a little: measured 2.2e-6 at most (4 ranks, cost plans), on entries
# of size ~0.1 (relative 1e-5). A lost or duplicated sample moves rows by ~lr.
TABLE_ATOL = 1e-5


def _train(balance: str, mode: str, *extra: str) -> dict:
    cfg = ["steps=10", "warmup=1", "eval_every=0", "progress=false", f"balance={balance}",
           f"mode={mode}", *extra]  # fmt: skip
    trainer = Trainer(build_config("demo", cfg))
    local: list[int] = []  # this rank's balanced batch sizes
    pop = BalanceStage.pop

    def recording_pop(stage):
        out = pop(stage)
        local.append(out[0].batch_size)
        return out

    with mock.patch.object(BalanceStage, "pop", recording_pop):
        trainer.run()
    return {
        "local": local,
        "losses": [s["loss"] for s in trainer.summary.steps],
        "samples": [s["samples"] for s in trainer.summary.steps],
        "table": trainer.embeddings.full_table("item_emb"),
        "dense": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
    }


@pytest.fixture(scope="module")
def baseline():
    return run_ranks(_train, 2, "none", "sync", timeout=240)[0]


@pytest.mark.parametrize("balance,mode", [("fbs", "sync"), ("cost", "sdd"), ("vbs", "sync")])
def test_balanced_training_matches_unbalanced(baseline, balance, mode):
    got = run_ranks(_train, 2, balance, mode, timeout=240)[0]
    _assert_same_run(got, baseline)


def test_balanced_training_matches_unbalanced_at_four_ranks():
    base = run_ranks(_train, 4, "none", "sync", timeout=300)[0]
    got = run_ranks(_train, 4, "cost", "sync", timeout=300)[0]
    _assert_same_run(got, base)


# Heavier-tailed lengths than the demo's, so that the cost partitioner does
# give ranks different counts (with the demo lengths equal counts win).
TAIL = ("length_median=3", "length_sigma=1.5")
VARIABLE = ("balance_counts=variable",)


@pytest.fixture(scope="module")
def tail_baseline():
    return run_ranks(_train, 2, "none", "sync", *TAIL, timeout=240)[0]


@pytest.mark.parametrize("mode", ["sync", "sdd"])
def test_variable_counts_match_unbalanced_and_really_vary(tail_baseline, mode):
    """Cost partitioner with variable local batch sizes (capped at 2 x batch):
    same math as unbalanced, and the local batches did differ in size."""
    ranks = run_ranks(_train, 2, "cost", mode, *TAIL, *VARIABLE, timeout=240)
    _assert_uneven([r["local"] for r in ranks], cap=2 * 32)  # demo batch_size = 32
    _assert_same_run(ranks[0], tail_baseline)


def test_variable_counts_match_unbalanced_at_four_ranks():
    base = run_ranks(_train, 4, "none", "sync", *TAIL, timeout=300)[0]
    ranks = run_ranks(_train, 4, "cost", "sync", *TAIL, *VARIABLE, "max_local_batch=40",
                      timeout=300)  # fmt: skip
    _assert_uneven([r["local"] for r in ranks], cap=40)
    _assert_same_run(ranks[0], base)


def _assert_uneven(sizes: list[list[int]], cap: int) -> None:
    assert all(0 < b <= cap for s in sizes for b in s)
    assert any(len(set(step)) > 1 for step in zip(*sizes, strict=True))


def _assert_same_run(got: dict, base: dict) -> None:
    assert got["samples"] == base["samples"]  # nothing lost or duplicated
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(base["losses"]),
                               rtol=RTOL, atol=ATOL)  # fmt: skip
    torch.testing.assert_close(got["table"], base["table"], rtol=RTOL, atol=TABLE_ATOL)
    for k, v in base["dense"].items():
        torch.testing.assert_close(got["dense"][k], v, rtol=RTOL, atol=DENSE_ATOL)


def _losses(tmp_path, plan_process: str) -> list[float]:
    path = tmp_path / f"{plan_process}.jsonl"
    cfg = ["steps=10", "warmup=1", "eval_every=0", "progress=false", "balance=fbs",
           f"plan_process={plan_process}", f"metrics_path={path}"]  # fmt: skip
    launch(build_config("demo", cfg))  # spawned ranks: run_ranks' daemons can't fork
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def test_planning_in_a_helper_process_gives_the_same_run(tmp_path):
    """The partitioner in its own process (off the trainer's GIL) plans exactly
    as in the balancer's thread: FBS depends on the lengths only."""
    assert _losses(tmp_path, "on") == _losses(tmp_path, "off")
