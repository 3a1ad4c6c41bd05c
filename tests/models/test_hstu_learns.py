"""The HSTU-style model learns the synthetic data, and the CLI trains it by name."""

import json
import subprocess
import sys

from freescale.models.hstu import build
from freescale.pipeline.config import build_config
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks


def _evals(overrides: list[str]) -> list[float]:
    trainer = Trainer(build_config("demo", [*overrides, "progress=false"]), model=build)
    trainer.run()
    return [e["ne"] for e in trainer.summary.evals]


def test_hstu_learns_the_synthetic_data():
    """The demo preset with the default HSTU: held-out NE falls over 60 steps."""
    evals = run_ranks(_evals, 2, ["steps=60", "eval_every=20", "mode=sdd"], timeout=240)[0]
    first, *_, last = evals
    assert last < 0.95 and last < first, evals


def test_cli_trains_it_by_name():
    proc = subprocess.run(
        [
            sys.executable, "-m", "freescale.cli.main", "train",
            "--set", "model=freescale.models.hstu:build", "--set", "model.dim=16",
            "--set", "nproc=1",
            "--set", "steps=4", "--set", "warmup=1", "--set", "eval_every=0",
            "--set", "progress=false", "--mode", "freescale",
        ],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["mode"] == "freescale"
