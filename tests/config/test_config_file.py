"""Config files: ``--print-config`` is TOML that ``--config`` reads
back to the same config; a file's bad key or value is one line naming the
file, the line and the key (rc 2, before any rank); a run from a file is the
run of the same ``--set``s."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest

import freescale
from freescale.cli.main import main
from freescale.config import PRESETS, build_config
from tests.config.test_config import _doc_keys

# Each with the options of a factory, feature lists and user data/model sources.
EXAMPLES = [
    [],
    ["model=examples.categories:build", "data=examples.categories:data",
     "data.num_categories=50", "model.smoothing=0.1", "run.mode=freescale"],
    ["data=parquet:users.parquet", "data.features=categories:uih,categories:candidates",
     "model.dim=64", "model.attention=reference"],
    ["data=pkg.mod:factory", "data.lists=[[1, 2], [3]]", "data.table={\"a\": 1, \"b\": [true]}",
     "data.name=it's \"quoted\"", "model=freescale.models.hstu:build", "model.dim=8"],
    ["run.timeout_s=1e30", "embeddings.lr=0.1", "faults.nan_steps=3,4", "output.trace_steps=2-3",
     "checkpoint.dir=runs/ck", "checkpoint.every=5", "balance=cost", "balance.counts=variable"],
]  # fmt: skip


def _print_config(capsys, *args: str) -> str:
    capsys.readouterr()
    assert main(["train", *args, "--print-config"]) == 0
    return capsys.readouterr().out


def _no_launch(monkeypatch):
    """Any rank starting fails the test: errors must come before."""

    def launch(*a, **k):
        raise AssertionError("a rank started")

    monkeypatch.setattr("freescale.run.launch.launch", launch)


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("example", range(len(EXAMPLES)))
def test_print_config_reads_back_to_the_same_config(tmp_path, capsys, preset, example):
    sets = [a for s in EXAMPLES[example] for a in ("--set", s)]
    text = _print_config(capsys, "--preset", preset, *sets)
    tomllib.loads(text)  # valid TOML
    path = tmp_path / "run.toml"
    path.write_text(text)
    assert _print_config(capsys, "--config", str(path)) == text
    assert freescale.load_config(path) == build_config(preset, EXAMPLES[example])


def test_every_key_of_the_docs_reads_back(tmp_path):
    for override in _doc_keys():
        extra = ["checkpoint.dir=ck"] if "every" in override.split("=")[0] else []
        extra += ["balance=cost"] if override.startswith("balance.counts") else []
        extra += ["output.dir=runs/x"] if override.startswith("output.tensorboard") else []
        if override.startswith("model.category"):
            extra += ["model=examples.categories:build"]
        if override.split("=")[0].endswith((".evict", ".admit_after")):  # a dynamic table's
            extra += [override.split("=")[0].rpartition(".")[0] + ".capacity=1000"]
        cfg = build_config("demo", [*extra, override])
        path = tmp_path / "run.toml"
        path.write_text(freescale.config_toml(cfg))
        assert freescale.load_config(path) == cfg, override


def test_a_small_file_sets_on_a_preset_and_set_wins(tmp_path, capsys):
    path = tmp_path / "small.toml"
    path.write_text(
        '[run]\nsteps = 40\nmode = "sdd"\n\n[model]\ndim = 64\n[data]\nlength_median = 20\n'
    )
    out = tomllib.loads(_print_config(capsys, "--config", str(path), "--set", "run.steps=9"))
    assert out["run"]["steps"] == 9 and out["run"]["mode"] == "sdd"
    assert out["model"]["options"] == {"dim": 64, "heads": 2, "layers": 1}
    assert out["data"]["length_median"] == 20.0  # an integer where a float goes: fine


@pytest.mark.parametrize(
    "text,line,words",
    [
        ('[run]\nsteps = 5\nmode = "sdd\n', 3, ["not TOML", "Illegal character"]),
        ("[run]\nsteps = 5\n[runs]\nsteps = 3\n", 3, ["unknown config section 'runs'"]),
        ("[run]\nsteps = 5\n\n  stepz = 3\n", 4, ["unknown config key 'run.stepz'"]),
        ('[run]\nwarmup = 1\nsteps = "many"\n', 3, ["run.steps expects a int, got 'many'"]),
        ("[dense]\ncompile = 1\n", 2, ["dense.compile expects a bool, got 1"]),
        ('[run]\nmode = "fast"\n', 2, ["run.mode must be one of sync, sdd, freescale"]),
        ("[model]\noptions = 3\n", 2, ["model.options must be a table"]),
        ("[evaluation]\nbatches = 0\n", 2, ["evaluation.batches must be >= 1"]),
        ('run = {steps = 3, warmup = "x"}\n', 1, ["run.warmup expects a int"]),
        ("[run]\nsteps = 5\n[run.extra]\nx = 1\n", 3, ["unknown config key 'run.extra'"]),
    ],
)
def test_a_bad_file_is_one_line_naming_file_line_and_key(
    tmp_path, capsys, monkeypatch, text, line, words
):
    _no_launch(monkeypatch)
    path = tmp_path / "bad.toml"
    path.write_text(text)
    rc = main(["train", "--config", str(path)])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"freescale: error: {path}:{line}: "), err
    for w in words:
        assert w in err, err


def test_a_missing_file_is_one_line(tmp_path, capsys, monkeypatch):
    _no_launch(monkeypatch)
    assert main(["train", "--config", str(tmp_path / "none.toml")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("freescale: error: cannot read config") and "none.toml" in err


def test_a_run_from_a_file_is_the_run_of_the_same_sets(tmp_path, capsys):
    sets = ["run.nproc=1", "run.steps=4", "run.warmup=1", "run.batch_size=8",
            "evaluation.every=0", "output.progress=false", "run.mode=freescale",
            "data.max_uih=24", "data.length_cap=24"]  # fmt: skip
    path = tmp_path / "run.toml"
    path.write_text(_print_config(capsys, *[a for s in sets for a in ("--set", s)]))
    from_file = freescale.train(config=path)
    from_sets = freescale.train(config=build_config("demo", sets))
    assert from_file is not None and from_sets is not None
    losses = [s["loss"] for s in from_file.steps]
    assert len(losses) == 4 and losses == [s["loss"] for s in from_sets.steps]


def test_null_options_are_refused_in_one_line():
    cfg = build_config("demo", ["data=pkg.mod:factory", "data.limit=null"])
    with pytest.raises(ValueError, match=r"data\.limit is null: TOML has no null"):
        freescale.config_toml(cfg)


def test_the_manifest_config_is_the_toml(tmp_path):
    from freescale.state.checkpoint import find_checkpoint, read_manifest

    cfg = build_config(
        "demo",
        ["run.nproc=1", "run.steps=2", "run.warmup=0", "run.batch_size=4", "evaluation.every=0",
         "output.progress=false", f"checkpoint.dir={tmp_path}", "checkpoint.every=2"],
    )  # fmt: skip
    freescale.train(config=cfg)
    found = find_checkpoint(tmp_path)
    assert found is not None
    text = (found / "config.toml").read_text()
    assert read_manifest(found)["config"] == tomllib.loads(text)
    assert "config.toml" in read_manifest(found)["files"]
    assert freescale.load_config(Path(found / "config.toml")) == cfg


def _simulated(capsys, *args: str) -> list[dict]:
    capsys.readouterr()
    assert main(["simulate", "--world-sizes", "4", "--steps", "3", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]


def test_simulate_projects_the_workload_of_a_config(tmp_path, capsys):
    sets = ["run.batch_size=8", "data.max_uih=200", "data.length_median=50",
            "data.length_cap=200", "run.mode=sdd", "model.dim=64", "run.seed=3"]  # fmt: skip
    path = tmp_path / "run.toml"
    path.write_text(_print_config(capsys, *[a for s in sets for a in ("--set", s)]))
    from_file = _simulated(capsys, "--config", str(path))
    flags = ["--modes", "sdd", "--balance", "none", "--batch-size", "8", "--max-uih", "200",
             "--length-median", "50", "--length-sigma", "0.8", "--length-cap", "200",
             "--max-candidates", "4", "--max-content", "2", "--embedding-dim", "64",
             "--seed", "3"]  # fmt: skip
    assert from_file == _simulated(capsys, *flags)
    given = _simulated(capsys, "--config", str(path), "--modes", "freescale")  # a flag wins
    assert [r["mode"] for r in given] == ["freescale"]
    path.write_text("[run]\nbatch_size = 0\n")
    assert main(["simulate", "--config", str(path)]) == 2
    assert f"{path}:2: run.batch_size must be >= 1" in capsys.readouterr().err
