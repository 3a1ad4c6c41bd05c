"""The HSTU-style model learns the synthetic data; the configuration names it."""

import pytest

from freescale.config import build_config
from freescale.jagged.schema import DataSchema
from freescale.models.hstu import HSTUModel, build
from freescale.pipeline.setup import build_model
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks


def _evals(overrides: list[str]) -> list[float]:
    trainer = Trainer(build_config("demo", [*overrides, "output.progress=false"]), model=build)
    trainer.run()
    return [e["ne"] for e in trainer.summary.evals]


@pytest.mark.slow
def test_hstu_learns_the_synthetic_data():
    """The demo preset with the default HSTU: held-out NE falls over 60 steps."""
    evals = run_ranks(
        _evals, 2, ["run.steps=60", "evaluation.every=20", "run.mode=sdd"], timeout=240
    )[0]
    first, *_, last = evals
    assert last < 0.95 and last < first, evals


def test_the_configuration_names_it():
    """``--set model=freescale.models.hstu:build`` with ``model.KEY`` options
    (the CLI's path for any factory: tests/examples/test_categories.py runs it)."""
    cfg = build_config("demo", ["model=freescale.models.hstu:build", "model.dim=16"])
    built = build_model(cfg.model, DataSchema.standard(cfg.data.num_items, 4))
    assert isinstance(built, HSTUModel) and built.cfg.dim == 16
    assert built.item_emb.num_embeddings == cfg.data.num_items
