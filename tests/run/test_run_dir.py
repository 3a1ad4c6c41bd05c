"""A run directory: ``output.dir`` gathers the config, the step
metrics, the summary, checkpoints, TensorBoard's events and the report; a
run started from its ``config.toml`` with ``--resume`` continues it there."""

from __future__ import annotations

import json
import sys
import tomllib

import numpy as np
import pytest

import freescale
from freescale.cli.main import main
from tests.config.test_config_file import _no_launch
from tests.pipeline.test_ranked_eval import write_data

# TensorBoard tag -> the step JSON's value (None: not in that step's line)
STEP_TAGS = {
    "train/loss": lambda r: r["loss"],
    "train/ne": lambda r: r["ne"],
    "perf/step_ms": lambda r: r["step_ms"],
    "perf/qps": lambda r: r["qps"],
    "perf/straggler_pct": lambda r: r["straggler_pct"],
    "perf/data_wait_ms": lambda r: r["data_wait_ms"],
    "perf/collision_rows_pct": lambda r: r["collision_rows_pct"],
    "exposed_comm_ms/emb_a2a": lambda r: r["exposed_comm_ms"]["emb_a2a"],
    "exposed_comm_ms/grad_a2a": lambda r: r["exposed_comm_ms"]["grad_a2a"],
    **{
        f"eval/{k}": (lambda r, k=k: r["eval"][k] if "eval" in r else None)
        for k in ("hr@10", "ndcg@10", "auc", "ne")
    },
}


def _scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _assert_events_equal_the_json(run_dir, steps: int) -> None:
    records = _lines(run_dir / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps))
    scalars = _scalars(run_dir)
    for tag, get in STEP_TAGS.items():
        want = [(r["step"], np.float32(get(r))) for r in records if get(r) is not None]
        assert want, tag
        assert scalars[tag] == want, tag


SETS = ["data=sasrec:s.txt", "data.eval_negatives=20", "run.nproc=2", "run.steps=4",
        "run.warmup=1", "run.batch_size=4", "run.mode=freescale", "evaluation.every=2",
        "evaluation.batches=1", "checkpoint.every=2", "output.progress=false",
        "output.dir=runs/a", "output.tensorboard=true", "data.max_uih=16",
        "model.dim=16"]  # fmt: skip


def _two_rank_run(tmp_path, monkeypatch):
    """4 steps of 2 CPU ranks into runs/a, from the command line."""
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    write_data(tmp_path / "s.txt", users=60)
    assert main(["train", *[a for s in SETS for a in ("--set", s)]]) == 0
    run = tmp_path / "runs" / "a"
    config = tomllib.loads((run / "config.toml").read_text())
    assert config["output"]["metrics_path"] == "runs/a/metrics.jsonl"
    assert config["checkpoint"]["dir"] == "runs/a/checkpoints"
    assert config["checkpoint"]["resume"] == ""  # --resume says when to continue
    assert json.loads((run / "summary.json").read_text())["steps"] == 4
    assert (run / "checkpoints" / "step-00000004" / "manifest.json").is_file()
    _assert_events_equal_the_json(run, 4)
    return run


def _continued(run, steps: int) -> None:
    _assert_events_equal_the_json(run, steps)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["first_step"] == 4 and summary["steps"] == steps - 4
    assert main(["report", "runs/a"]) == 0
    assert f"{steps} steps" in (run / "report.md").read_text()


def test_a_two_rank_run_dir_with_tensorboard_resumes_in_place(tmp_path, monkeypatch, capsys):
    run = _two_rank_run(tmp_path, monkeypatch)
    # Started again from its config: a fresh start there is refused, --resume continues.
    _no_launch(monkeypatch)
    capsys.readouterr()
    assert main(["train", "--config", "runs/a/config.toml"]) == 2
    assert "runs/a holds a run already" in capsys.readouterr().err
    resumed = ["--config", "runs/a/config.toml", "--resume", "--print-config"]
    assert main(["train", *resumed]) == 0
    assert tomllib.loads(capsys.readouterr().out)["checkpoint"]["resume"] == "runs/a/checkpoints"
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    # (the command's run in this process: --resume is checkpoint.resume=checkpoint.dir)
    freescale.train(
        config="runs/a/config.toml",
        run={"steps": 6, "nproc": 1},
        checkpoint={"resume": "runs/a/checkpoints"},
    )
    _continued(run, 6)


@pytest.mark.slow
def test_the_command_resumes_a_run_dir(tmp_path, monkeypatch, capsys):
    run = _two_rank_run(tmp_path, monkeypatch)
    resumed = ["--config", "runs/a/config.toml", "--resume", "--set", "run.steps=7"]
    assert main(["train", *resumed]) == 0
    _continued(run, 7)
    capsys.readouterr()
    assert main(["eval", "--config", "runs/a/config.toml"]) == 0  # its newest checkpoint
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["checkpoint"].endswith("step-00000006") and out["eval"]["test"]["users"] > 0


def test_tensorboard_needs_its_package_and_a_run_dir(tmp_path, monkeypatch, capsys):
    _no_launch(monkeypatch)
    assert main(["train", "--set", "output.tensorboard=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "freescale: error: output.tensorboard=true needs output.dir (the run directory)"
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # not installed
    out = f"output.dir={tmp_path / 'r'}"
    assert main(["train", "--set", out, "--set", "output.tensorboard=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("freescale: error: output.tensorboard=true needs the tensorboard")
    assert "pip install 'freescale[tensorboard]'" in err and "\n" not in err
    monkeypatch.undo()  # the Python API checks in its launcher, before any rank too
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ValueError, match="needs the tensorboard package"):
        freescale.train(run={"nproc": 1}, output={"dir": str(tmp_path / "r"), "tensorboard": True})
    assert not (tmp_path / "r" / "config.toml").exists()


def test_without_a_run_dir_nothing_changes(capsys):
    out = tomllib.loads(_print(capsys))
    assert out["output"]["dir"] == "" and out["output"]["metrics_path"] == ""
    assert out["checkpoint"]["dir"] == "" and out["output"]["tensorboard"] is False


def test_explicit_paths_win_over_the_run_dir(capsys):
    out = tomllib.loads(
        _print(capsys, "output.dir=runs/b", "checkpoint.dir=elsewhere", "output.trace_steps=2-3")
    )
    assert out["checkpoint"]["dir"] == "elsewhere"
    assert out["output"]["metrics_path"] == "runs/b/metrics.jsonl"
    assert out["output"]["trace_path"] == "runs/b/trace-{rank}.json"


def _print(capsys, *sets: str) -> str:
    capsys.readouterr()
    assert main(["train", *[a for s in sets for a in ("--set", s)], "--print-config"]) == 0
    return capsys.readouterr().out
