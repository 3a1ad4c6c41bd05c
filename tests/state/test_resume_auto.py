"""``checkpoint.resume=auto`` / ``--resume auto``: one command for the
first start and every restart. The newest complete checkpoint in
``checkpoint.dir`` if there is one, else a fresh start, said in one line and
in the summary's ``resumed``; the metrics file reads as one run."""

import json

import freescale
from freescale.cli.main import main
from freescale.config import build_config
from freescale.state.checkpoint import PREFIX

COMMON = ["run.nproc=1", "run.warmup=1", "run.batch_size=8", "model.dim=16", "model.layers=1",
          "evaluation.every=0", "output.progress=false"]  # fmt: skip


def _train(steps: int, ckpt, metrics, *checkpoint: str) -> dict:
    keys = [*COMMON, f"run.steps={steps}", f"output.metrics_path={metrics}"]
    keys += [f"checkpoint.dir={ckpt}", *checkpoint]
    return freescale.train(config=build_config("demo", keys)).summary


def _steps(metrics) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, metrics.read_text().splitlines())]


def test_auto_starts_fresh_then_resumes_from_the_newest(tmp_path, capsys):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    first = _train(4, ckpt, metrics, "checkpoint.every=2", "checkpoint.resume=auto")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"freescale: checkpoint.resume=auto: no complete checkpoint in {str(ckpt)!r}:"
        " starting at step 0"
    )
    assert first["first_step"] == 0 and first["resumed"] is None
    # The attempt got two steps further before it died: their lines are dropped,
    # and so is a line torn by the kill.
    with metrics.open("a") as f:
        f.write(json.dumps({"step": 4, "loss": 0.0}) + "\n" + '{"step": 5, "lo')
    again = _train(6, ckpt, metrics, "checkpoint.every=2", "checkpoint.resume=auto")
    line = capsys.readouterr().err.strip().splitlines()[-1]
    newest = ckpt / f"{PREFIX}{4:08d}"
    assert line == f"freescale: checkpoint.resume=auto: resuming from {newest} (step 4)"
    assert again["first_step"] == 4 and again["resumed"]["step"] == 4
    whole = tmp_path / "whole.jsonl"
    _train(6, tmp_path / "other", whole)
    assert _steps(metrics) == _steps(whole)  # bit for bit, every step once


def test_resume_auto_on_the_command_line(tmp_path, capsys):
    assert main(["train", "--resume", "auto"]) == 2
    assert capsys.readouterr().err.strip() == (
        "freescale: error: checkpoint.resume=auto needs checkpoint.dir (where to look)"
        " or output.dir"
    )
    args = ["train", "--set", f"checkpoint.dir={tmp_path}", "--resume", "auto", "--print-config"]
    assert main(args) == 0
    assert 'resume = "auto"' in capsys.readouterr().out.splitlines()
