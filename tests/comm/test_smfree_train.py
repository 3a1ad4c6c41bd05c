"""Training with ``comm_backend=smfree`` is bit-identical to ``torch`` (2 CPU ranks)."""

import pytest
import torch

from freescale.comm.nixl_support import INSTALL_HINT, nixl_installed
from freescale.config import MODES, build_config
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks
from tests.pipeline.test_train import assert_same_run

COMMON = ["run.steps=6", "run.warmup=1", "evaluation.every=0", "output.progress=false"]


def _train(overrides: list[str]) -> dict:
    trainer = Trainer(build_config("demo", [*COMMON, *overrides]))
    trainer.run()
    return {
        "comm": type(trainer.sparse.comm).__name__,
        "transport": getattr(getattr(trainer.sparse.comm, "transport", None), "name", None),
        "overlap": type(trainer.sparse.overlap_comm).__name__,
        "losses": [s["loss"] for s in trainer.summary.steps],
        "evals": [e["ne"] for e in trainer.summary.evals],
        "table": trainer.embeddings.full_table("item_emb"),
        "opt_state": trainer.embeddings.full_optimizer_state("item_emb"),
        "dense": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
    }


@pytest.mark.parametrize(
    "setting",
    [
        pytest.param("run.mode=sync", marks=pytest.mark.slow),
        pytest.param("run.mode=sdd", marks=pytest.mark.slow),
        pytest.param("run.mode=sdd,balance=fbs", marks=pytest.mark.slow),
        "run.mode=freescale,balance=fbs",
    ],
)
def test_smfree_training_is_bit_identical_to_torch(setting):
    overrides = setting.split(",")
    torch_runs = run_ranks(_train, 2, [*overrides, "pipeline.comm_backend=torch"], timeout=240)
    smfree_runs = run_ranks(_train, 2, [*overrides, "pipeline.comm_backend=smfree"], timeout=240)
    for a, b in zip(torch_runs, smfree_runs, strict=True):
        assert (a["comm"], b["comm"]) == ("TorchCommunicator", "SmFreeCommunicator")
        assert len(a["losses"]) == 6
        assert_same_run(a, b)


@pytest.mark.parametrize("mode", [pytest.param("sdd", marks=pytest.mark.slow), "freescale"])
def test_overlapped_categories_on_smfree_are_bit_identical_to_torch(mode):
    """Prefetches, deferred gradients and balancer stage III on smfree, the
    blocking exchanges on torch: the same numbers as all on torch."""
    overrides = [f"run.mode={mode}", "balance=fbs"]
    torch_runs = run_ranks(_train, 2, [*overrides, "pipeline.comm_backend=torch"], timeout=240)
    mixed = run_ranks(_train, 2, [*overrides, "pipeline.comm_overlapped=smfree"], timeout=240)
    for a, b in zip(torch_runs, mixed, strict=True):
        assert b["overlap"] == "SmFreeCommunicator" and b["comm"] == "TorchCommunicator"
        assert a["losses"] == b["losses"]
        assert torch.equal(a["table"], b["table"])
        for k in a["dense"]:
            assert torch.equal(a["dense"][k], b["dense"][k]), k


def test_comm_backend_is_validated():
    assert build_config("demo").pipeline.comm_backend == "torch"
    with pytest.raises(ValueError, match="comm_backend must be one of torch, smfree"):
        build_config("demo", ["pipeline.comm_backend=nccl"])
    with pytest.raises(ValueError, match="comm_overlapped must be one of torch, smfree"):
        build_config("demo", ["pipeline.comm_overlapped=nvlink"])


NIXL_RUNS = [
    *(pytest.param(m, 2, marks=pytest.mark.slow) for m in ("sync", "sdd")),
    ("freescale", 2),
    *(pytest.param(m, w, marks=pytest.mark.slow) for w in (1, 3, 4) for m in MODES),
]


@pytest.mark.skipif(not nixl_installed(), reason=f"no NIXL ({INSTALL_HINT})")
@pytest.mark.parametrize(("mode", "world"), NIXL_RUNS)
def test_smfree_nixl_training_is_bit_identical_to_torch(mode, world):
    overrides = [f"run.mode={mode}", "balance=fbs"] if world > 1 else [f"run.mode={mode}"]
    torch_runs = run_ranks(_train, world, [*overrides, "pipeline.comm_backend=torch"], timeout=240)
    nixl_runs = run_ranks(
        _train, world, [*overrides, "pipeline.comm_backend=smfree-nixl"], timeout=240
    )
    for a, b in zip(torch_runs, nixl_runs, strict=True):
        assert b["comm"] == "SmFreeCommunicator" and b["transport"] == "nixl"
        assert len(a["losses"]) == 6
        assert_same_run(a, b)
