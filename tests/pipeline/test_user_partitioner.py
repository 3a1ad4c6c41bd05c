"""A user's own partitioner, written from docs/balance.md, chosen as
``module:qualname`` on the command line, in a config file and from Python
(the function itself): it plans every step of every rank, in every mode with
the same numbers; a plan that loses or duplicates a sample stops every rank
with one line naming the step; an unknown name is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import freescale
from freescale.cli.main import main
from freescale.config import build_config
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks

STEPS = 4
RUN = {"steps": STEPS, "warmup": 1}
SETS = [f"run.steps={STEPS}", "run.warmup=1", "evaluation.every=0", "output.progress=false"]

# What a user writes after reading docs/balance.md: longest first, dealt
# round-robin; each call is written down (step, rank, process) to check it runs.
USER_MODULE = """
import multiprocessing
import os

import torch

from freescale.balance import Plan, RuntimeInfo, WorldLengths


def plan(world: WorldLengths, runtime: RuntimeInfo) -> Plan:
    rank, process = os.environ.get("RANK", "0"), multiprocessing.current_process().name
    with open(os.path.join(os.environ["CALLS_DIR"], f"rank{rank}.txt"), "a") as f:
        f.write(f"{runtime.step} {process}\\n")
    longest_first = torch.argsort(world.uih_lengths, descending=True, stable=True)
    dest = torch.empty(world.total, dtype=torch.int64)
    dest[longest_first] = torch.arange(world.total) % world.world_size
    return Plan.from_dest(dest, world.world_size)


def duplicating(world: WorldLengths, runtime: RuntimeInfo) -> Plan:
    good = plan(world, runtime)
    if runtime.step < 2:
        return good
    order = good.order.clone()
    order[1] = order[0]  # sample order[0] twice, order[1] lost
    return Plan(order, good.counts)
"""


@pytest.fixture
def user_code(tmp_path, monkeypatch) -> Path:
    """``mypart.py`` importable the way a user's is: from the working directory
    (spawned ranks and their planning processes too, through PYTHONPATH)."""
    (tmp_path / "mypart.py").write_text(USER_MODULE)
    (tmp_path / "calls").mkdir()
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("CALLS_DIR", str(tmp_path / "calls"))
    monkeypatch.delitem(sys.modules, "mypart", raising=False)
    return tmp_path


def _calls(user_code: Path, world: int) -> list[list[tuple[int, str]]]:
    """Per rank, the (step, process name) of each call; the log starts afresh."""
    out = []
    for rank in range(world):
        path = user_code / "calls" / f"rank{rank}.txt"
        lines = path.read_text().split("\n")[:-1] if path.exists() else []
        out.append([(int(s), p) for s, p in (line.split() for line in lines)])
        path.unlink(missing_ok=True)
    return out


def _assert_called_every_step(calls: list[list[tuple[int, str]]], helper: bool) -> None:
    for rank_calls in calls:
        assert sorted(step for step, _ in rank_calls) == list(range(STEPS)), calls
        # plan_process=on: in the balancer's planning process, as the built-ins
        assert all(p.startswith("ForkServerProcess") == helper for _, p in rank_calls), calls


def _python_run(world: int, mode: str, plan_process: str = "off") -> dict:
    from mypart import plan

    result = freescale.train(
        run={**RUN, "nproc": world, "mode": mode},
        evaluation={"every": 0},
        output={"progress": False},
        balance=plan,
        state_dict=True,
    )
    assert result is not None
    return {"losses": [s["loss"] for s in result.steps], "state": result.state_dict}


def _same(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(
        torch.equal(a["state"][k], b["state"][k]) for k in a["state"]
    )


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_a_python_partitioner_plans_every_step_bit_identically_in_every_mode(user_code, world):
    runs = {}
    for mode in ("sync", "sdd", "freescale"):
        runs[mode] = _python_run(world, mode)
        _assert_called_every_step(_calls(user_code, world), helper=False)
    assert _same(runs["sdd"], runs["sync"]) and _same(runs["freescale"], runs["sync"])


def _metrics_losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


@pytest.mark.slow  # two CLI runs (~30 s); the Python test runs the same partitioner
def test_the_cli_and_a_config_file_name_it_module_qualname(user_code):
    """``--set balance=mypart:plan`` (planning in its helper process) and a
    file's ``[balance] method``: the same runs as from Python."""
    want = _python_run(2, "sdd")["losses"]
    _calls(user_code, 2)
    cli = user_code / "cli.jsonl"
    sets = [*SETS, "balance=mypart:plan", "balance.plan_process=on", "run.nproc=2",
            "run.mode=freescale", f"output.metrics_path={cli}"]  # fmt: skip
    command = [sys.executable, "-m", "freescale.cli.main", "train"]
    proc = subprocess.run(
        [*command, *(a for s in sets for a in ("--set", s))],
        capture_output=True, text=True, timeout=300, cwd=user_code,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert _metrics_losses(cli) == want
    _assert_called_every_step(_calls(user_code, 2), helper=True)
    from_file = user_code / "file.jsonl"
    (user_code / "run.toml").write_text(
        f'[run]\nnproc = 2\nmode = "sync"\n[balance]\nmethod = "mypart:plan"\n'
        f'[output]\nmetrics_path = "{from_file}"\n'
    )
    assert main(["train", "--config", "run.toml", *(a for s in SETS for a in ("--set", s))]) == 0
    assert _metrics_losses(from_file) == want
    _assert_called_every_step(_calls(user_code, 2), helper=False)


def _bad_plan_line(world: int, user_code: Path) -> str:
    sys.path.insert(0, str(user_code))  # (the harness's ranks fork from a server of their own)
    os.environ["CALLS_DIR"] = str(user_code / "calls")
    cfg = build_config("demo", [*SETS, "balance=mypart:duplicating", f"run.nproc={world}"])
    try:
        Trainer(cfg).run()
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_bad_plan_stops_every_rank_with_one_line_naming_the_step(user_code, capsys):
    lines = run_ranks(_bad_plan_line, 3, 3, user_code, timeout=300)
    want = "step 2: partitioner 'mypart:duplicating' returned a bad plan: plan loses samples"
    assert len(set(lines)) == 1 and lines[0].startswith(want), lines
    assert "\n" not in lines[0]
    sets = [*SETS, "balance=mypart:duplicating", "run.nproc=2"]
    assert main(["train", *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"freescale: error: {want}"), err


def test_an_unknown_name_is_one_line_listing_the_builtins(capsys):
    assert main(["train", "--set", "balance=round", "--print-config"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "freescale: error: balance.method must be one of none, fbs, vbs, cost, or your own"
        " partitioner as module:qualname (e.g. mymodule:plan, a function"
        " partition(world, runtime) -> Plan); got 'round'"
    ]


def test_user_code_that_does_not_import_is_one_line_before_any_rank(user_code, capsys):
    for name, why in [("nomodule:plan", "cannot import 'nomodule'"),
                      ("mypart:nothing", "mypart has no callable 'nothing'")]:  # fmt: skip
        assert main(["train", "--set", f"balance={name}", "--set", "run.nproc=2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"balance.method={name!r}: {why}" in err[0], err


def test_python_refuses_a_partitioner_it_cannot_name():
    with pytest.raises(ValueError, match="has no module:qualname name that imports it"):
        freescale.train(balance=lambda world, runtime: None, run={"nproc": 2})
    with pytest.raises(ValueError, match=r"balance\.method must be one of none, fbs.*; got 3"):
        freescale.train(balance=3, run={"nproc": 2})
