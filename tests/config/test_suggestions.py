"""A mistyped key, format or factory name says what to write instead, in one line."""

import os
import subprocess
import sys

import pytest

from freescale.config import build_config
from freescale.models.contract import load_object
from freescale.pipeline.setup import make_source


@pytest.mark.parametrize(
    "setting,message",
    [
        ("run.step=3", "unknown config key 'run.step'; did you mean 'run.steps'?"),
        ("runs.steps=3", "unknown config key 'runs.steps'; did you mean 'run.steps'?"),
        (
            "evaluation.evry=2",
            "unknown config key 'evaluation.evry'; did you mean 'evaluation.every'?",
        ),
        ("nosuchkey=1", "unknown config key 'nosuchkey'; keys are section.key, sections: run, "),
    ],
)
def test_an_unknown_key_names_the_nearest(setting, message):
    with pytest.raises(ValueError) as e:
        build_config("demo", [setting])
    assert str(e.value).startswith(message) and len(str(e.value)) < 300, str(e.value)


def test_an_unknown_key_without_a_near_one_lists_its_section_only():
    with pytest.raises(ValueError) as e:
        build_config("demo", ["checkpoint.zzz=1"])
    line = str(e.value)
    assert line.startswith("unknown config key 'checkpoint.zzz'; the keys of [checkpoint]: ")
    assert "checkpoint.every" in line and "run.steps" not in line


def test_a_misspelt_data_format_names_the_built_in_one():
    with pytest.raises(ValueError) as e:
        make_source(build_config("demo", ["data=parket:/x.parquet"]))
    assert str(e.value) == (
        "data='parket:/x.parquet': 'parket' is no data format; did you mean 'parquet'? "
        "(built-in formats: synthetic, sasrec, movielens, parquet, csv, parquet-stream)"
    )


def test_a_factory_that_does_not_import_says_where_python_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "/nowhere")
    with pytest.raises(ValueError) as e:
        load_object("mymodel_nowhere:build", "model")
    assert str(e.value) == (
        "model='mymodel_nowhere:build': cannot import 'mymodel_nowhere' (No module named "
        f"'mymodel_nowhere'); Python looked in the working directory {tmp_path}, PYTHONPATH "
        "(/nowhere) and the installed packages: run from the directory that holds "
        "mymodel_nowhere.py (or mymodel_nowhere/), or add that directory to PYTHONPATH"
    )


def test_a_factory_whose_own_import_fails_keeps_that_error(tmp_path, monkeypatch):
    (tmp_path / "brokenmodel.py").write_text("import not_installed_dependency\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError) as e:
        load_object("brokenmodel:build", "model")
    assert "No module named 'not_installed_dependency'" in str(e.value)
    assert "Python looked" not in str(e.value)


def test_the_cli_prints_the_nearest_key_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", "train", "--set", "run.stpes=2"],
        capture_output=True, text=True, timeout=120, env={**os.environ},
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "freescale: error: unknown config key 'run.stpes'; did you mean 'run.steps'?"
    )
