"""A bad row of ``parquet-stream`` data, from the user's side: one line naming the
file, row group, row and column, exit status 2, on every rank, before step 0
(with ``data.check=off``: the same line at the step that reads the row)."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import freescale
from freescale.config import build_config
from freescale.data import SequenceSampling, SyntheticConfig, open_source
from freescale.pipeline import train
from freescale.pipeline.train import Trainer
from freescale.run.launch import RankInputError, RunFailed
from freescale.run.supervise import Rank, StopSignals, Supervisor
from freescale.testing import run_ranks
from freescale.testing.multirank import free_port

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROOT = Path(__file__).resolve().parents[2]
B = 4
KEYS = ["data.shuffle=false", "data.shuffle_buffer=10", "evaluation.every=0"]
COMMON = ["run.warmup=1", "output.progress=false", f"run.batch_size={B}", "run.steps=8"]


def _bad_late_data(directory: Path) -> str:
    """Two files of 5 row groups of 10 rows, one sample each (pieces 0-9 in file
    order; shuffle off): rank 1 of 2 reads pieces 1, 3, 5, 7, 9, a window each. Row 23
    of part-1 (row group 2: piece 7) is bad; rank 1 reaches it at step 7 (samples
    28-31 of its stream). Returns the line every rank must raise."""
    directory.mkdir()
    for k in range(2):
        rows = [[1, 2, 3, 4, 5]] * 50
        if k == 1:
            rows[23] = [1, 2, 3, 4, 5, 6]  # 'actions' keeps 5 values: lengths differ
        table = pa.table({"items": rows, "actions": [[0, 1, 0, 1, 0]] * 50})
        table = table.replace_schema_metadata({"freescale.num_items": "50"})
        pq.write_table(table, directory / f"part-{k}.parquet", row_group_size=10)
    return f"{directory / 'part-1.parquet'}: row group 2, row 23: actions has 5 values, items has 6"


def _train_rank(data: str, metrics: str, check: str) -> dict:
    cfg = build_config(
        "demo",
        [*COMMON, *KEYS, f"data=parquet-stream:{data}", f"data.check={check}",
         f"output.metrics_path={metrics}"],
    )  # fmt: skip
    try:
        Trainer(cfg).run()
    except ValueError as e:
        return {"error": str(e)}
    return {"error": None}


@pytest.mark.slow
@pytest.mark.parametrize("check", ["on", "off"])
def test_a_late_bad_row_of_rank_1_is_every_ranks_line_before_step_0(tmp_path, check):
    """On: found before step 0 (the metrics file is never opened). Off: the same line
    when rank 1 reaches the row, after some steps. Fast twins: the trainer's hook at
    one rank (`test_the_python_api_raises_the_line`), the ranks' agreement
    (`test_stream_check.test_every_rank_raises_the_first_problem_in_piece_order`),
    the step's line with the check off (`test_stream_check.test_with_the_check_off_...`)."""
    want = _bad_late_data(tmp_path / "d")
    metrics = tmp_path / "m.jsonl"
    out = run_ranks(_train_rank, 2, str(tmp_path / "d"), str(metrics), check, timeout=180)
    assert out[0] == out[1] == {"error": out[0]["error"]}, out
    assert out[0]["error"].startswith(want), out[0]
    if check == "on":
        assert not metrics.exists()
    else:
        steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
        assert steps and max(steps) < 7, steps


def test_the_python_api_raises_the_line(tmp_path, monkeypatch):
    """In-process (nproc=1): the trainer's check raises before the model is built."""
    want = _bad_late_data(tmp_path / "d")
    monkeypatch.setattr(train, "build_model", lambda *a: pytest.fail("a model was built"))
    sampling = SequenceSampling(max_uih=4, shuffle=False)
    source = open_source(f"parquet-stream:{tmp_path / 'd'}", SyntheticConfig(), sampling)
    with pytest.raises(ValueError) as e:
        freescale.train(data=source, run={"nproc": 1, "steps": 3, "warmup": 1})
    assert str(e.value).startswith(want)


def _rank_fails(messages, kind: str, line: str) -> None:
    messages.send((kind, line))
    os._exit(2 if kind == "input" else 1)


@pytest.mark.parametrize("kind", ["input", "error"])
def test_a_ranks_value_error_is_the_launchers_value_error(kind):
    """A spawned rank's ValueError (its line, already agreed by the ranks) is a
    ValueError of the launcher, the CLI's rc 2; anything else stays `RunFailed`, rc 1."""
    ctx = multiprocessing.get_context("fork")
    messages, rank_end = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_rank_fails, args=(rank_end, kind, "data.parquet: row group 3: bad"))
    proc.start()
    rank_end.close()
    with pytest.raises(RunFailed) as e:
        Supervisor([Rank(1, proc, messages)], StopSignals(), timeout_s=60).run()
    proc.join(timeout=10)
    if kind == "input":
        assert isinstance(e.value, RankInputError) and isinstance(e.value, ValueError)
        assert str(e.value) == "data.parquet: row group 3: bad"
    else:
        assert not isinstance(e.value, ValueError)
        assert str(e.value) == "rank 1 failed: data.parquet: row group 3: bad"


def _cli(*args: str, torchrun: bool = False) -> subprocess.CompletedProcess:
    launcher = [sys.executable, "-m", "freescale.cli.main"]
    if torchrun:
        launcher = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
            "-m", "freescale.cli.main",
        ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [*launcher, "train", *args], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher and its ranks
            proc.wait(timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _args(tmp_path: Path, nproc: int) -> list[str]:
    keys = [*COMMON, *KEYS, f"data=parquet-stream:{tmp_path / 'd'}"]
    keys.append(f"output.metrics_path={tmp_path / 'm.jsonl'}")
    return [*(a for k in keys for a in ("--set", k)), "--nproc", str(nproc)]


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_cli_exits_2_with_one_line_and_no_step(tmp_path, nproc):
    """Fast twins: the run_ranks test above (the ranks' line, before step 0) and the
    launcher's (a rank's ValueError is the CLI's rc 2)."""
    want = _bad_late_data(tmp_path / "d")
    proc = _cli(*_args(tmp_path, nproc))
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(err) == 1 and err[0].startswith(f"freescale: error: {want}"), err
    assert proc.stdout == "" and not (tmp_path / "m.jsonl").exists()


@pytest.mark.slow
def test_under_torchrun_each_rank_prints_the_line_and_exits_2(tmp_path):
    want = _bad_late_data(tmp_path / "d")
    proc = _cli(*_args(tmp_path, 2)[:-2], torchrun=True)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("freescale: error:")]
    assert proc.returncode != 0 and len(lines) == 2, proc.stderr[-3000:]
    assert all(line.startswith(f"freescale: error: {want}") for line in lines), lines
    # torchrun reports the first rank to exit (2); it may stop the other before its own exit
    assert proc.stderr.count("exitcode  : 2 ") >= 1
    assert proc.stdout == "" and not (tmp_path / "m.jsonl").exists()
