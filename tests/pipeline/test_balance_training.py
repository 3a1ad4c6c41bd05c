"""Training with load balancing on vs off: same math up to float reassociation.

Balancing moves samples between ranks (and reorders them) within a global
step. The loss is normalized by the global candidate count and dense
gradients are summed over ranks, so the update is the same function of the
global batch; only the order of floating-point additions changes (per-rank
partial sums of the loss/gradients, the arrival order of duplicate embedding
rows). Hence equality up to a small relative tolerance, not bit equality.
"""

import json

import pytest
import torch

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


def _train(balance: str, mode: str, *extra: str) -> dict:
    cfg = ["steps=10", "warmup=1", "eval_every=0", "progress=false", f"balance={balance}",
           f"mode={mode}", *extra]  # fmt: skip
    trainer = Trainer(build_config("demo", cfg))
    trainer.run()
    return {
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
    assert got["samples"] == baseline["samples"]  # nothing lost or duplicated
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(baseline["losses"]),
                               rtol=RTOL, atol=ATOL)  # fmt: skip
    torch.testing.assert_close(got["table"], baseline["table"], rtol=RTOL, atol=ATOL)
    for k, v in baseline["dense"].items():
        torch.testing.assert_close(got["dense"][k], v, rtol=RTOL, atol=DENSE_ATOL)


def test_balanced_training_matches_unbalanced_at_four_ranks():
    base = run_ranks(_train, 4, "none", "sync", timeout=300)[0]
    got = run_ranks(_train, 4, "cost", "sync", timeout=300)[0]
    assert got["samples"] == base["samples"]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(base["losses"]),
                               rtol=RTOL, atol=ATOL)  # fmt: skip
    torch.testing.assert_close(got["table"], base["table"], rtol=RTOL, atol=ATOL)
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
