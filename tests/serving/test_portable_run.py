"""From a user's file to a served model, away from the training directory.

A model of one's own (`tests/fixtures/own_model/mymodel.py`, two sharded
tables) trains on a SASRec file whose raw item ids are sparse and far from
``0..N-1``. Its checkpoint then evaluates from another directory on a copy of
the file (``--data``) with the run's own test metrics, exports where no data
file exists, and the served program takes the catalogue's raw ids.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from freescale.cli.main import main
from freescale.config import TrainConfig
from freescale.data.readers import read_sasrec
from freescale.data.sequences import SequenceSource
from freescale.serving import load
from freescale.serving.checkpoint import checked, plain_state
from freescale.state.checkpoint import find_checkpoint

ROOT = Path(__file__).resolve().parents[2]
CODE = ROOT / "tests" / "fixtures" / "own_model"
STRIDE = 1_000_003  # raw ids: multiples of it, first seen in no particular order


def _write_sasrec(path: Path) -> None:
    rng = np.random.default_rng(7)
    raw = (rng.permutation(30) + 1) * STRIDE
    lines = []
    for user in range(48):
        for item in rng.choice(raw, int(rng.integers(5, 10))):
            lines.append(f"{user * 11} {item}")
    path.write_text("\n".join(lines) + "\n")


def _cli(cwd: Path, *argv: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CODE), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", *argv],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(the training directory, its checkpoint, the training run's summary)."""
    home = tmp_path_factory.mktemp("home")
    _write_sasrec(home / "my.txt")
    sets = ["data=sasrec:my.txt", "model=mymodel:build", "run.nproc=1", "run.steps=6",
            "run.warmup=1", "run.batch_size=8", "evaluation.every=0", "output.progress=false",
            "checkpoint.dir=ck", "checkpoint.every=6"]  # fmt: skip
    summary = _cli(home, "train", *(a for s in sets for a in ("--set", s)))
    return home, find_checkpoint(home / "ck"), summary


def test_eval_elsewhere_on_a_copy_gives_the_runs_test_metrics(run, tmp_path):
    home, ck, trained = run
    shutil.copy(home / "my.txt", tmp_path / "copy.txt")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    args = ["eval", str(ck), "--model", "mymodel:build", "--data", f"sasrec:{tmp_path}/copy.txt"]
    got = _cli(elsewhere, *args)
    assert got["command"] == "eval"
    assert got["eval"]["test"] == trained["eval"]["test"]
    assert got["eval"]["valid"] == trained["eval"]["valid"]


def test_the_checkpoint_records_its_data_absolutely_with_its_ids(run):
    home, ck, _ = run
    manifest = json.loads((ck / "manifest.json").read_text())
    data = manifest["data"]
    assert data["source"] == f"sasrec:{home / 'my.txt'}"
    assert len(data["sha256"]) == 64 and "ids/items.npy" in manifest["files"]
    raw = np.load(ck / "ids" / "items.npy", allow_pickle=False)
    assert raw.size == 30 and (raw % STRIDE == 0).all()
    assert raw.tolist() == read_sasrec(home / "my.txt").item_ids.tolist()


def test_export_needs_no_data_file_and_serves_raw_ids(run, tmp_path, monkeypatch, capsys):
    home, ck, _ = run
    monkeypatch.chdir(tmp_path)  # no my.txt here, nor anywhere the manifest points
    monkeypatch.syspath_prepend(str(CODE))
    moved = shutil.move(home / "my.txt", tmp_path.parent / "moved.txt")
    try:
        assert main(["export", str(ck), "out", "--model", "mymodel:build"]) == 0
    finally:
        shutil.move(moved, home / "my.txt")
    capsys.readouterr()
    served = load(tmp_path / "out")
    assert served.raw_ids
    # the eval forward: the plain model with the checkpoint's weights, on rows
    found, manifest, trainer = checked(ck)
    config = TrainConfig.from_dict(manifest["config"])
    import mymodel

    dataset = read_sasrec(home / "my.txt")
    source = SequenceSource(dataset, config.data.synthetic_configs(config.run.seed)[1])
    plain = mymodel.build(source.schema).eval()
    plain.load_state_dict(plain_state(found, trainer, plain))
    rows = source.eval_batch("test", 0, 0, 1, 6)
    raw = torch.from_numpy(dataset.item_ids)
    uih = {**rows.uih.features, "item_ids": raw[rows.uih["item_ids"]]}
    cand = {**rows.candidates.features, "item_ids": raw[rows.candidates["item_ids"]]}
    given = rows.__class__(
        uih=type(rows.uih)(rows.uih.offsets, uih),
        candidates=type(rows.candidates)(rows.candidates.offsets, cand),
        labels=rows.labels, content=rows.content, sample_id=rows.sample_id,
    )  # fmt: skip
    assert int(given.candidates["item_ids"].min()) >= STRIDE
    with torch.no_grad():
        expected = plain(rows)
    assert torch.equal(served(given), expected)
    assert torch.equal(load(tmp_path / "out", raw_ids=False)(rows), expected)
    unknown = given.candidates["item_ids"].clone()
    unknown[3] = 5
    with pytest.raises(ValueError, match=r"candidates.item_ids: 5 is not in the export's id map"):
        served(type(given)(**{**given.__dict__, "candidates": type(rows.candidates)(
            rows.candidates.offsets, {**cand, "item_ids": unknown})}))  # fmt: skip


def test_eval_with_other_data_is_refused_naming_eval(run, tmp_path):
    _, ck, _ = run
    other = tmp_path / "other.txt"
    other.write_text("1 2\n1 3\n1 4\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CODE), str(ROOT)])}
    proc = subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", "eval", str(ck), "--model", "mymodel:build",
         "--data", f"sasrec:{other}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 2
    line = proc.stderr.strip()
    assert line.startswith("freescale: error: eval: ") and "resume" not in line
    assert f"{other}:1: item 2 is not in the checkpoint's id map" in line


def test_data_of_another_schema_is_one_line_naming_the_command():
    from freescale import DataSchema
    from freescale.serving.checkpoint import check_schema

    saved, found = DataSchema.standard(30, 1), DataSchema.standard(30, 11)
    check_schema(saved, saved, "sasrec:/x.txt", "eval")
    with pytest.raises(ValueError) as e:
        check_schema(saved, found, "movielens:/r.dat", "export")
    assert str(e.value) == (
        "export: movielens:/r.dat is not the run's data: uih.actions 11 rows, the checkpoint's "
        "1 rows (a file elsewhere must hold the same schema)"
    )
