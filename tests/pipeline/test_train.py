"""The staged pipeline on CPU ranks: sync, sdd and freescale agree bit for bit, and it learns."""

import json
import subprocess
import sys

import pytest
import torch

from freescale.config import build_config
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks


def _train_and_collect(overrides: list[str]) -> dict:
    trainer = Trainer(build_config("demo", [*overrides, "output.progress=false"]))
    before = trainer.embeddings.full_table("item_emb")
    trainer.run()
    table = trainer.embeddings.full_table("item_emb")
    opt_state = trainer.embeddings.full_optimizer_state("item_emb")
    dense = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    return {
        "losses": [s["loss"] for s in trainer.summary.steps],
        "evals": [e["ne"] for e in trainer.summary.evals],
        "table": table,
        "table_before": before,
        "opt_state": opt_state,
        "dense": dense,
        "summary_keys": sorted(trainer.summary.steps[-1]),
    }


@pytest.fixture(scope="module")
def runs():
    common = ["run.steps=20", "run.warmup=2", "evaluation.every=0"]
    return {
        mode: run_ranks(_train_and_collect, 2, [*common, f"run.mode={mode}"], timeout=240)
        for mode in ("sync", "sdd", "freescale")
    }


def assert_same_run(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    assert a["evals"] == b["evals"]
    assert torch.equal(a["table"], b["table"])
    assert a["opt_state"].keys() == b["opt_state"].keys()
    for k in a["opt_state"]:
        assert torch.equal(a["opt_state"][k], b["opt_state"][k]), k
    for k in a["dense"]:
        assert torch.equal(a["dense"][k], b["dense"][k]), k


@pytest.mark.parametrize("mode", ["sdd", "freescale"])
def test_modes_are_bit_identical_to_sync(runs, mode):
    for rank in range(2):
        assert_same_run(runs["sync"][rank], runs[mode][rank])


def test_ranks_agree_on_replicated_dense_weights_and_metrics(runs):
    r0, r1 = runs["sync"]
    for k in r0["dense"]:
        assert torch.equal(r0["dense"][k], r1["dense"][k]), k
    assert r0["losses"] == r1["losses"]
    assert {"straggler_pct", "exposed_comm_ms", "qps", "ne"} <= set(r0["summary_keys"])


def test_training_updates_the_sharded_table(runs):
    r0 = runs["sync"][0]
    changed = (r0["table"] != r0["table_before"]).any(dim=1)
    assert 0 < int(changed.sum()) < changed.numel()  # touched rows only


def test_demo_learns_short_version():
    """The README demo, shortened: held-out NE falls below 0.95."""
    out = run_ranks(
        _train_and_collect, 2, ["run.steps=40", "evaluation.every=20", "run.mode=sdd"], timeout=240
    )
    first, last = out[0]["evals"]
    assert last < 0.95 and last < first, (first, last)


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", "train", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    "args,message",
    [
        (["--set", "nosuchkey=1"], "unknown config key 'nosuchkey'"),
        (["--set", "run.batch_size=-4"], "batch_size must be >= 1, got -4"),
        (["--set", "item_dim=16"], "unknown config key 'item_dim'; did you mean 'model.dim'?"),
        (["--set", "run.steps=ten"], "steps expects a int"),
    ],
)
def test_bad_configs_fail_at_start_with_one_line(args, message):
    proc = _cli(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("freescale: error:") and message in last, proc.stderr


def test_more_ranks_than_samples_fails_at_start(tmp_path):
    data = tmp_path / "tiny.txt"
    data.write_text("1 1\n1 2\n2 1\n2 3\n")  # two users -> two samples
    proc = _cli("--set", f"data=sasrec:{data}", "--nproc", "3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "do not fill one global batch of world size 3" in proc.stderr


def test_train_cli_prints_a_json_summary(tmp_path):
    metrics = tmp_path / "m.jsonl"
    proc = _cli(
        "--set",
        "run.steps=6",
        "--set",
        "run.warmup=1",
        "--set",
        "evaluation.every=3",
        "--set",
        f"output.metrics_path={metrics}",
        "--set",
        "output.progress=false",
        "--set",
        f"output.trace_path={tmp_path / 'trace.json'}",
        "--set",
        "output.trace_steps=2-3",
    )
    assert proc.returncode == 0, proc.stderr
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("ProfilerStep#2" in n for n in names), sorted(names)[:20]
    # Exactly the window: step 1 only warmed the profiler up (its start-up cost stays out).
    assert {n for n in names if n.startswith("ProfilerStep#")} == {
        "ProfilerStep#2",
        "ProfilerStep#3",
    }
    assert (tmp_path / "trace.rank1.json").exists()  # one file per rank
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 6 and summary["world_size"] == 2
    assert set(summary["exposed_comm_ms"]) >= {"ids_a2a", "emb_a2a", "grad_a2a", "dense_allreduce"}
    assert len(metrics.read_text().splitlines()) == 6
    # the built-in model counts its FLOPs; a CPU has no peak: MFU null, never a guess
    for line in metrics.read_text().splitlines():
        step = json.loads(line)
        assert step["step_tflop"] > 0 and step["tflops"] > 0 and step["mfu_pct"] is None
        assert len(step["tflops_ranks"]) == 2
    assert summary["tflops"] > 0 and summary["mfu_pct"] is None and summary["peak_tflops"] is None
    report = subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", "report", str(metrics), "--warmup", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report.returncode == 0, report.stderr
    assert "straggler %" in report.stdout
    assert "TFLOP/s per GPU" in report.stdout and "MFU" not in report.stdout
    assert (tmp_path / "m" / "report.md").exists()
