"""A model that breaks the contract (docs/your-model.md) is told so in one line,
naming its class and what to change, before step 0 updates anything: CLI
status 2, the same ValueError on every rank."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from freescale.config import build_config
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]
SETS = ["model=tests.pipeline._contract_mistakes:build", "run.steps=2", "run.warmup=0",
        "run.batch_size=8", "evaluation.every=0", "output.progress=false",
        "run.timeout_s=60"]  # fmt: skip
EXPECTED = {
    "per_sample": "PerSample.forward returned shape [8] for ",
    "forgot_content": "ForgotContent.embedding_inputs(batch) names no input for sharded "
    "module(s) ['content']",
    "not_finite": "NotFinite.forward returned non-finite logits",
    "integer": "Integer.forward returned torch.int64 logits: return float logits",
    "vector_loss": "VectorLoss.loss returned a loss of shape [",
}


def _cli(mistake: str) -> subprocess.CompletedProcess:
    sets = [a for x in [*SETS, f"model.mistake={mistake}"] for a in ("--set", x)]
    paths = [str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    return subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", "train", *sets],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    "mistake", ["per_sample", pytest.param("forgot_content", marks=pytest.mark.slow)]
)
def test_a_contract_mistake_is_one_line_and_status_2(mistake):
    proc = _cli(mistake)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr.strip()
    assert "\n" not in err and len(err) <= 300, err  # one paragraph: ≤ 3 terminal lines
    assert err.startswith("freescale: error: "), err
    assert EXPECTED[mistake] in err, err
    assert '"step"' not in proc.stdout, proc.stdout  # no step finished


def _train(mistake: str) -> str:
    cfg = build_config("demo", [*SETS, f"model.mistake={mistake}"])
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    try:
        trainer.run()
    except ValueError as e:
        after = trainer.model.state_dict()
        assert all(before[k].equal(after[k]) for k in before)  # nothing updated
        return str(e)
    return "trained"


@pytest.mark.parametrize("mistake", sorted(EXPECTED))
@pytest.mark.parametrize("world", [1, 2])
def test_every_rank_raises_the_same_line(world, mistake):
    lines = run_ranks(_train, world, mistake, timeout=120)
    assert len(set(lines)) == 1 and EXPECTED[mistake] in lines[0], lines
    assert "\n" not in lines[0] and len(lines[0]) <= 280, lines[0]


def test_the_mistakes_train_once_fixed():
    """The fixture itself trains: each line above is the mistake's, not the fixture's."""
    cfg = build_config("demo", [*SETS, "model=tests.pipeline._two_tables:build"])
    assert run_ranks(_train_config, 1, cfg, timeout=120) == ["trained"]


def _train_config(cfg) -> str:
    Trainer(cfg).run()
    return "trained"
