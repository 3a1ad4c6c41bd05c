"""Every value that used to fail inside the ranks fails in the launcher: one
line, rc 2, before any rank starts (in-process: nothing is spawned)."""

import json
import os
import time

import pytest

from freescale.cli.main import main
from freescale.config import build_config
from freescale.state.checkpoint_files import FORMAT


def _rc_and_last_line(capsys, *args: str) -> tuple[int, str, float]:
    start = time.perf_counter()
    rc = main(["train", "--set", "run.steps=8", *args])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one line, no traceback
    return rc, err[0], elapsed


@pytest.mark.parametrize(
    "args,message",
    [
        (["--set", "data.max_uih=0"], "max_uih must be >= 1"),
        (["--set", "data.length_cap=0"], "length_cap must be >= 1"),
        (["--set", "dense.lr=nan"], "dense.lr must be a finite number > 0, got nan"),
        (["--set", "embeddings.lr=inf"], "embeddings.lr must be a finite number > 0, got inf"),
        (
            ["--set", "model.attention=varlen", "--set", "run.device=cpu"],
            "model.attention=varlen needs a CUDA",
        ),
        (
            ["--set", "model.attention=cudnn", "--set", "run.device=cpu"],
            "model.attention=cudnn needs a CUDA",
        ),
        (
            ["--set", "model.cross_attention=triton", "--set", "run.device=cpu"],
            "model.cross_attention=triton needs a CUDA",
        ),
        (
            ["--set", "model.attention=cudnn", "--set", "model.dim=72", "--set", "model.heads=2"],
            "model.attention=cudnn needs a head dim that is a multiple of 8",
        ),
        (["--set", "output.metrics_path=/proc/nope/m.jsonl"], "metrics_path: cannot create"),
        (["--set", "data=sasrec:/no/such/file.txt"], "data file '/no/such/file.txt'"),
        (["--set", "run.timeout_s=0"], "run.timeout_s must be a finite number >= 1"),
        (["--set", "faults.nonfinite=ignore"], "nonfinite must be one of raise, skip"),
        (["--set", "faults.nonfinite_max_skips=-1"], "nonfinite_max_skips must be >= 0"),
        (["--set", "checkpoint.every=5"], "checkpoint.every needs checkpoint.dir"),
        (["--resume"], "--resume without DIR needs checkpoint.dir"),
        (["--set", "faults.delay_ranks=5"], "faults.delay_ranks='5' names a rank outside 0..1"),
        (
            ["--set", "pipeline.sync_debug=true", "--set", "run.device=cpu"],
            "pipeline.sync_debug=true reports",
        ),
        (["--set", "faults.delay_ranks=x"], "faults.delay_ranks must be comma-separated numbers"),
        (["--set", "pipeline.comm_overlapped=nvlink"], "comm_overlapped must be one of"),
        (["--set", "data.step_overlap=1.5"], "step_overlap must lie in [0, 1]"),
        (["--set", "balance.plan_process=maybe"], "plan_process must be one of auto, on, off"),
        (["--set", "data.loader_workers=-3"], "loader_workers must be -1 (auto) or >= 0"),
    ],
)
def test_bad_values_fail_in_the_launcher_with_one_line(capsys, args, message):
    rc, line, elapsed = _rc_and_last_line(capsys, *args)
    assert rc == 2
    assert line.startswith("freescale: error:") and message in line, line
    assert elapsed < 5


ADAGRAD = {"optimizer": "adagrad", "lr": 0.05, "assignment": "hashed"}


def _fake_checkpoint(path, **config) -> None:
    """A complete checkpoint as far as the launcher reads it before its files (the manifest)."""
    path.mkdir(parents=True)
    cfg = {**build_config("demo", []).as_dict(), **config}
    manifest = {"format": FORMAT, "step": 5, "world_size": 2, "samples_seen": 160, "config": cfg}
    manifest["files"] = {}
    (path / "manifest.json").write_text(json.dumps(manifest))


def test_resume_checks_the_checkpoint_in_the_launcher(capsys, tmp_path):
    rc, line, _ = _rc_and_last_line(capsys, "--resume", str(tmp_path / "none"))
    assert rc == 2 and "no complete checkpoint" in line
    # An Adagrad checkpoint into an SGD run: refused, not sum_sq silently dropped.
    _fake_checkpoint(tmp_path / "ck" / "step-00000005", embeddings=ADAGRAD)
    rc, line, _ = _rc_and_last_line(
        capsys, "--set", "embeddings.optimizer=sgd", "--resume", str(tmp_path / "ck")
    )
    assert rc == 2 and "embeddings.optimizer='adagrad' (this run: 'sgd')" in line, line
    # Another world size is no reason to refuse (the tables reshard): the
    # check goes on to the files, which this fake does not list.
    rc, line, _ = _rc_and_last_line(
        capsys,
        "--set",
        "embeddings.optimizer=adagrad",
        "--resume",
        str(tmp_path / "ck"),
        "--nproc",
        "3",
    )
    assert rc == 2 and "its manifest lists no trainer.pt" in line, line
    _fake_checkpoint(tmp_path / "ck3" / "step-00000005")
    manifest = json.loads((tmp_path / "ck3" / "step-00000005" / "manifest.json").read_text())
    manifest["samples_seen"] = -1
    (tmp_path / "ck3" / "step-00000005" / "manifest.json").write_text(json.dumps(manifest))
    rc, line, _ = _rc_and_last_line(capsys, "--resume", str(tmp_path / "ck3"))
    assert rc == 2 and "is malformed (step, world_size, samples_seen" in line, line
    # a partial (crashed) save is never picked
    (tmp_path / "ck2" / "step-00000009.partial").mkdir(parents=True)
    rc, line, _ = _rc_and_last_line(capsys, "--resume", str(tmp_path / "ck2"))
    assert rc == 2 and "no complete checkpoint" in line


def test_cpu_ranks_honour_omp_num_threads(monkeypatch):
    from freescale.run.launch import _rank_threads

    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert _rank_threads(2) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert _rank_threads(2) == max(1, (os.cpu_count() or 1) // 2)
