"""A model FreeScale did not write (examples/categories.py) through every technique.

Two sharded tables called separately in ``forward``, extra features at two
levels, its own loss: the three modes give bit-identical losses, tables,
optimizer state and dense weights at each world size, with and without the
sequence load balancer; the Python API and the CLI train it; a bad id in one
of its features is one line on every rank.
"""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

import freescale
from examples.categories import CATEGORY, WithCategories, build, category_of, data, write_parquet
from freescale.config import build_config
from freescale.data import open_source
from freescale.data.source import schema_of
from freescale.pipeline.setup import check_data
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks

TABLES = ("items", "categories")
FEATURES = "categories:uih,categories:candidates"
needs_pyarrow = pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is None, reason="needs pyarrow (the data extra)"
)


def _run(overrides: list[str], num_categories: int = 30) -> dict:
    cfg = build_config("demo", [*overrides, "output.progress=false", "evaluation.every=0"])
    trainer = Trainer(cfg, model=build, data=data(num_categories=num_categories))
    emb = trainer.embeddings
    before = {t: emb.full_table(t) for t in TABLES}
    trainer.run()
    return {
        "before": before,
        "losses": [s["loss"] for s in trainer.summary.steps],
        "ne": [s["ne"] for s in trainer.summary.steps],
        "tables": {t: emb.full_table(t) for t in TABLES},
        "state": {t: emb.full_optimizer_state(t) for t in TABLES},
        "dense": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for t in TABLES:
        assert torch.equal(a["tables"][t], b["tables"][t]), t
        for k in a["state"][t]:
            assert torch.equal(a["state"][t][k], b["state"][t][k]), (t, k)
    assert a["dense"].keys() == b["dense"].keys()
    for k in a["dense"]:
        assert torch.equal(a["dense"][k], b["dense"][k]), k


def _modes_agree(world: int, balance: str) -> None:
    common = ["run.steps=8", "run.warmup=1", f"run.nproc={world}", f"balance={balance}",
              "run.batch_size=8", "pipeline.prioritize=on"]  # fmt: skip
    runs = {
        mode: run_ranks(_run, world, [*common, f"run.mode={mode}"], timeout=240)
        for mode in ("sync", "sdd", "freescale")
    }
    for mode in ("sdd", "freescale"):
        for rank in range(world):
            _assert_same(runs["sync"][rank], runs[mode][rank])
    first = runs["sync"][0]
    for t in TABLES:  # both sharded tables were trained (rows touched by the batches)
        changed = (first["tables"][t] != first["before"][t]).any(dim=1)
        assert int(changed.sum()) > 0, t


@pytest.mark.parametrize("balance", [pytest.param("none", marks=pytest.mark.slow), "cost"])
def test_modes_are_bit_identical_at_two_ranks(balance):
    _modes_agree(2, balance)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("balance", ["none", "fbs", "cost"])
def test_modes_are_bit_identical_at_every_world_size(world, balance):
    _modes_agree(world, balance)


def test_python_api_gives_summary_steps_and_the_plain_model():
    result = freescale.train(
        model=build, data=data(num_categories=30), state_dict=True,
        run={"nproc": 1, "steps": 6, "warmup": 1, "mode": "freescale"},
        evaluation={"every": 0}, output={"progress": False},
    )  # fmt: skip
    assert result is not None and len(result.steps) == 6
    assert result.summary["steps"] == 6 and result.steps[-1]["loss"] > 0
    torch.manual_seed(0)  # the trainer's seed: ``initial`` is the model it started from
    initial = build(data(num_categories=30).schema)
    plain = build(data(num_categories=30).schema)
    missing = plain.load_state_dict(result.state_dict)
    assert not missing.missing_keys and not missing.unexpected_keys
    for name in ("items", "categories"):
        trained, start = getattr(plain, name).weight, getattr(initial, name).weight
        changed = (trained != start).any(dim=1)
        # rows the batches touched moved, the others are exactly where they started
        assert 0 < int(changed.sum()) < changed.numel() or name == "categories"
        assert torch.equal(trained[~changed], start[~changed])
    batch = data(num_categories=30).batch(0, 0, 1, 4)
    assert plain(batch).shape == batch.labels.shape


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", "train", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_cli_trains_the_example_by_name():
    proc = _cli(
        "--set", "model=examples.categories:build", "--set", "model.dim=16",
        "--set", "data=examples.categories:data", "--set", "data.num_categories=20",
        "--set", "run.steps=4", "--set", "run.warmup=1", "--set", "evaluation.every=0",
        "--set", "output.progress=false", "--mode", "freescale",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 4 and summary["mode"] == "freescale"


class _BadCategory(WithCategories):
    """Rank 1's batch of step 3 holds a category id beyond the table."""

    def batch(self, step, rank, world_size, batch_size):
        b = super().batch(step, rank, world_size, batch_size)
        if step == 3 and rank == 1 and b.uih[CATEGORY].numel():
            b.uih.features[CATEGORY][-1] = self.num_categories + 7
        return b


def _run_bad(overrides):
    source = data(num_categories=30)
    bad = _BadCategory(source.source, 30)
    trainer = Trainer(
        build_config("demo", [*overrides, "output.progress=false", "evaluation.every=0"]),
        model=build,
        data=bad,
    )
    try:
        trainer.run()
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("mode", [pytest.param("sync", marks=pytest.mark.slow), "freescale"])
def test_bad_id_in_a_user_feature_is_one_line_on_every_rank(mode):
    out = run_ranks(_run_bad, 2, ["run.steps=6", f"run.mode={mode}"], timeout=120)
    assert out[0] == out[1] and out[0] is not None
    assert "rank 1, step 3" in out[0] and "uih feature 'category' id 37" in out[0], out[0]
    assert "outside [0, 30)" in out[0] and "\n" not in out[0]


def _run_bad_one_rank(overrides):
    """As `_run_bad`, one rank whose batch of step 3 holds the bad id."""
    source = data(num_categories=30)

    class BadAtStep3(WithCategories):
        def batch(self, step, rank, world_size, batch_size):
            b = super().batch(step, rank, world_size, batch_size)
            if step == 3 and b.uih[CATEGORY].numel():
                b.uih.features[CATEGORY][-1] = self.num_categories + 7
            return b

    cfg = build_config("demo", [*overrides, "output.progress=false", "evaluation.every=0"])
    trainer = Trainer(cfg, model=build, data=BadAtStep3(source.source, 30))
    try:
        trainer.run()
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["sync", "freescale"])
def test_bad_id_in_a_user_feature_on_a_gpu_is_one_line(mode):
    """On a GPU too: the host check names it; no device-side assert, no IndexError."""
    overrides = ["run.steps=6", f"run.mode={mode}", "run.device=cuda", "run.nproc=1",
                 "pipeline.prioritize=on"]  # fmt: skip
    overrides.append("data.loader_workers=0")  # the harness's rank is a daemon: no children
    (msg,) = run_ranks(_run_bad_one_rank, 1, overrides, timeout=180)
    assert msg is not None and "step 3" in msg and "uih feature 'category' id 37" in msg, msg


# ---- from a file: python -m examples.categories, data.features -------------------


def _sasrec_file(tmp_path, users=12, seed=0):
    rng = np.random.default_rng(seed)
    lines = [
        f"{u} {i}\n" for u in range(users) for i in rng.integers(100, 140, int(rng.integers(0, 9)))
    ]
    (tmp_path / "s.txt").write_text("".join(lines))
    return tmp_path / "s.txt"


@needs_pyarrow
def test_written_parquet_has_the_sasrec_split_and_hashed_categories(tmp_path):
    src = _sasrec_file(tmp_path, users=30)
    proc = subprocess.run(
        [sys.executable, "-m", "examples.categories", str(src), str(tmp_path / "c.parquet"), "7"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    sasrec = open_source(f"sasrec:{src}")
    par = open_source(f"parquet:{tmp_path / 'c.parquet'}", options={"features": FEATURES})
    assert schema_of(par).rows("uih", "categories") <= 7 and par.num_items == sasrec.num_items
    for split in ("valid", "test"):  # the same users, targets and sampled negatives
        a, b = sasrec.eval_batch(split, 0, 0, 1, 64), par.eval_batch(split, 0, 0, 1, 64)
        assert torch.equal(a.uih["item_ids"], b.uih["item_ids"])
        assert torch.equal(a.candidates["item_ids"], b.candidates["item_ids"])
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "c.parquet").to_pydict()
    for items, cats in zip(table["items"], table["categories"], strict=True):
        assert cats == [int(category_of(np.uint64(i), 7)) for i in items]


@needs_pyarrow
def test_the_example_trains_from_a_parquet_file_by_name(tmp_path):
    src = _sasrec_file(tmp_path, users=40)
    write_parquet(src, tmp_path / "c.parquet", 5)
    proc = _cli(
        "--set", f"data=parquet:{tmp_path / 'c.parquet'}", "--set", f"data.features={FEATURES}",
        "--set", "model=examples.categories:build", "--set", "model.category=categories",
        "--set", "model.dim=8", "--set", "run.steps=3", "--set", "run.warmup=1",
        "--set", "run.batch_size=4", "--set", "data.samples_per_user=0",
        "--set", "evaluation.every=0", "--set", "output.progress=false", "--set", "run.nproc=1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 3 and summary["eval"]["test"]["users"] > 0


@needs_pyarrow
def test_a_misaligned_feature_column_is_one_line_and_status_2(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({"items": [[1, 2, 3], [2, 3]], "categories": [[0, 1, 2], [1]]}),
        tmp_path / "bad.parquet",
    )
    proc = _cli(
        "--set", f"data=parquet:{tmp_path / 'bad.parquet'}", "--set", f"data.features={FEATURES}",
        "--set", "model=examples.categories:build", "--set", "model.category=categories",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert "bad.parquet: row 2: categories has 1 values, items has 2" in err and "\n" not in err
    typo = build_config("demo", [f"data=parquet:{tmp_path / 'bad.parquet'}", "data.feature=x"])
    with pytest.raises(ValueError, match=r"takes data\.features; got data\.feature$"):
        check_data(typo, 1)
