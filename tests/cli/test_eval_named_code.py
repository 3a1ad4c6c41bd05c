"""`freescale eval CKPT` and `freescale export` never import code that a
checkpoint names: a model or data factory FreeScale does not ship runs only
when the caller names the same one (docs/security.md)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from freescale.cli.main import main
from freescale.state.checkpoint import find_checkpoint

ROOT = Path(__file__).resolve().parents[2]
FACTORY = "tests.run._dying_model:build"  # the built-in model, under a name FreeScale does not ship


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    ck = tmp_path_factory.mktemp("ck")
    args = ["train", "--set", f"model={FACTORY}", "--set", "run.nproc=1", "--set", "run.steps=2",
            "--set", "run.warmup=1", "--set", "run.batch_size=8", "--set", "model.dim=16",
            "--set", "model.layers=1", "--set", "evaluation.every=0",
            "--set", "output.progress=false", "--set", f"checkpoint.dir={ck}",
            "--set", "checkpoint.every=2"]  # fmt: skip
    assert main(args) == 0
    return find_checkpoint(ck)


def _cli(*argv: str, path: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(p) for p in (path, ROOT) if p)}
    return subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _planted(checkpoint: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the checkpoint whose manifest names a factory that, imported,
    leaves a marker file (the manifest holds the other files' digests, not its own)."""
    copy = tmp_path / "planted"
    subprocess.run(["cp", "-r", str(checkpoint), str(copy)], check=True)
    marker = tmp_path / "imported"
    code = tmp_path / "code"
    code.mkdir()
    (code / "planted_factory.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\nfrom tests.run._dying_model import build\n"
    )
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["config"]["model"]["factory"] = "planted_factory:build"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy, marker


@pytest.mark.parametrize("command", ["eval", "export"])
def test_a_planted_factory_is_refused_and_never_imported(checkpoint, tmp_path, command):
    copy, marker = _planted(checkpoint, tmp_path)
    code = tmp_path / "code"
    argv = [command, str(copy)] + ([str(tmp_path / "out")] if command == "export" else [])
    proc = _cli(*argv, path=code)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == (
        f"freescale: error: {command}: the checkpoint was trained with model=planted_factory:build;"
        " name it (--model planted_factory:build, or model= in Python) to import it: a checkpoint"
        " never chooses the code that runs (docs/security.md)"
    )
    assert not marker.exists()


def test_eval_runs_a_factory_the_caller_names(checkpoint, capsys):
    assert main(["eval", str(checkpoint), "--model", FACTORY]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["command"] == "eval" and summary["step"] == 2
    proc = _cli("eval", str(checkpoint), "--model", "tests.other:build")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"freescale: error: eval: the checkpoint was trained with model={FACTORY}, "
        "not tests.other:build"
    )
