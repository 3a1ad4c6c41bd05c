"""A model written the TorchRec way (one EmbeddingCollection, a shared table, a KJT)
trains through the trainer in all three modes at 2 ranks, bit-identically."""

import pytest
import torch

pytest.importorskip("torchrec")

from examples.torchrec_style import build
from freescale.config import build_config
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks

TABLES = ("ec.item_table", "ec.action_table")


def _run(overrides: list[str]) -> dict:
    cfg = build_config("demo", [*overrides, "output.progress=false", "evaluation.every=0"])
    trainer = Trainer(cfg, model=build)
    emb = trainer.embeddings
    before = emb.full_table("ec.item_table")
    trainer.run()
    return {
        "losses": [s["loss"] for s in trainer.summary.steps],
        "before": before,
        "tables": {t: emb.full_table(t) for t in TABLES},
        "state": {t: emb.full_optimizer_state(t) for t in TABLES},
        "dense": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
    }


def test_torchrec_style_model_is_bit_identical_across_modes():
    common = ["run.steps=6", "run.warmup=1", "run.batch_size=8"]
    runs = {
        m: run_ranks(_run, 2, [*common, f"run.mode={m}", "pipeline.prioritize=on"], timeout=240)
        for m in ("sync", "sdd", "freescale")
    }
    for mode in ("sdd", "freescale"):
        for rank in range(2):
            a, b = runs["sync"][rank], runs[mode][rank]
            assert a["losses"] == b["losses"], mode
            for t in TABLES:
                assert torch.equal(a["tables"][t], b["tables"][t]), (mode, t)
                for k in a["state"][t]:
                    assert torch.equal(a["state"][t][k], b["state"][t][k]), (mode, t, k)
            for k in a["dense"]:
                assert torch.equal(a["dense"][k], b["dense"][k]), (mode, k)
    first = runs["sync"][0]
    assert (first["tables"]["ec.item_table"] != first["before"]).any()  # the shared table trained
