"""Training on ``parquet-stream`` data with 2 gloo ranks: a run stopped and resumed
at the same world size trains on exactly the uninterrupted run's samples, with
bit-identical losses; resumed at 1 rank it trains on the rest of the epoch,
no sample read twice, and its checkpoint records both world sizes."""

import json
import math

import pytest
import torch

from freescale.config import build_config
from freescale.data.parquet_stream import split_sample_id
from freescale.pipeline.train import Trainer
from freescale.state.checkpoint import PREFIX
from freescale.testing import run_ranks
from tests.data.test_parquet_stream import write_logs

pytest.importorskip("pyarrow")

B = 8
COMMON = ["run.warmup=1", "output.progress=false", f"run.batch_size={B}", "run.steps=10"]


def _samples(trainer: Trainer, steps: range) -> list[tuple[int, int, int]]:
    """The ids this rank trained on at ``steps`` (the loader reads the same calls)."""
    source, rank, world = trainer.train_source, trainer.rank, trainer.world
    ids = [source.batch(s, rank, world, B).sample_id.tolist() for s in steps]
    return [split_sample_id(i) for step in ids for i in step]


def _data_keys(data: str) -> list[str]:
    return [f"data=parquet-stream:{data}", "data.shuffle_buffer=60", "evaluation.every=5"]


def _resume_rank(data: str, ckdir: str) -> dict:
    data_keys = _data_keys(data)
    every = ["checkpoint.every=5", f"checkpoint.dir={ckdir}"]
    full = Trainer(build_config("demo", [*COMMON, *data_keys, *every]))
    full.run()
    resume = f"checkpoint.resume={ckdir}/{PREFIX}00000005"
    resumed = Trainer(build_config("demo", [*COMMON, *data_keys, resume]))
    torch.manual_seed(123)  # the RNG state must come from the checkpoint
    resumed.run()
    return {
        "full": [(s["step"], s["loss"]) for s in full.summary.steps],
        "resumed": [(s["step"], s["loss"]) for s in resumed.summary.steps],
        "full_ids": _samples(full, range(5, 10)),
        "resumed_ids": _samples(resumed, range(5, 10)),
        "first_ids": _samples(full, range(5)),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """(data, checkpoints, per rank: 10 steps, and steps 5-9 resumed at 2 ranks)."""
    tmp = tmp_path_factory.mktemp("stream")
    write_logs(tmp / "data", files=3, users=200, row_group=25)
    per_rank = run_ranks(_resume_rank, 2, str(tmp / "data"), str(tmp / "ck"), timeout=240)
    return tmp / "data", tmp / "ck", per_rank


def test_resume_at_the_same_world_size_is_exact(two_ranks):
    per_rank = two_ranks[2]
    for out in per_rank:
        full = dict(out["full"])
        assert [s for s, _ in out["resumed"]] == list(range(5, 10))
        for step, loss in out["resumed"]:
            assert full[step] == loss, step  # bit-identical
        assert out["resumed_ids"] == out["full_ids"]
    ids = [i for out in per_rank for i in out["first_ids"] + out["full_ids"]]
    assert len(set(ids)) == len(ids)  # 10 steps x 2 ranks: less than an epoch, no repeat
    assert len({f for f, _, _ in ids}) > 1  # the shares mix the files


def _one_rank(data: str, resume: str, ckdir: str) -> dict:
    keys = [f"checkpoint.resume={resume}", f"checkpoint.dir={ckdir}", "checkpoint.every=5"]
    trainer = Trainer(build_config("demo", [*COMMON, *_data_keys(data), *keys]))
    summary = trainer.run()
    source = trainer.train_source
    return {
        "summary": summary,
        "losses": [(s["step"], s["loss"]) for s in trainer.summary.steps],
        "ids": _samples(trainer, range(5, 10)),
        "epochs": [e for s in range(5, 10) for e in source.batch_epochs(s, 0, 1, B)],
    }


@pytest.mark.slow
def test_resume_at_another_world_size_reads_the_rest_of_the_epoch(two_ranks):
    """2 ranks -> 1 at step 5: the one rank trains on, no sample of the epoch
    read twice; its summary and its own checkpoint say how the run went.
    (Fast twin, without ranks: test_stream_resume.py::test_the_source_a_resumed_run_gets.)"""
    data, ckdir, per_rank = two_ranks
    (out,) = run_ranks(
        _one_rank, 1, str(data), str(ckdir / f"{PREFIX}00000005"), str(ckdir / "at1"), timeout=240
    )
    summary = out["summary"]
    assert summary["first_step"] == 5 and summary["world_size"] == 1
    assert [s for s, _ in out["losses"]] == list(range(5, 10))
    assert all(math.isfinite(loss) for _, loss in out["losses"])
    assert summary["resumed"] == {
        "step": 5, "from_world_size": 2, "samples_seen": 5 * 2 * B,
        "data_position": "redealt", "segments": [[0, 2], [5, 1]],
    }  # fmt: skip
    before = [i for r in per_rank for i in r["first_ids"]]
    assert out["epochs"] == [0] * (5 * B)  # all in epoch 0, as the 2-rank steps were
    assert len(set(before + out["ids"])) == len(before) + len(out["ids"])
    manifest = json.loads((ckdir / "at1" / f"{PREFIX}00000010" / "manifest.json").read_text())
    assert manifest["segments"] == [[0, 2], [5, 1]]
    assert (manifest["world_size"], manifest["samples_seen"]) == (1, 5 * 2 * B + 5 * B)


def _bad_rank(data: str) -> str:
    keys = [f"data=parquet-stream:{data}", "data.shuffle=false", "evaluation.every=0"]
    try:
        Trainer(build_config("demo", [*COMMON, *keys])).run()
    except ValueError as e:
        return str(e)
    return "no error"


def test_a_bad_row_read_by_one_rank_is_every_ranks_one_line_error(tmp_path):
    """Rank 0 reads the first row group (shuffle off), where row 2 has an item
    id beyond the table: both ranks raise its one line before training on it."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = [[1, 2, 3, 4, 5]] * 40
    rows[2] = [1, 2, 3, 4, 90]
    table = pa.table({"items": rows}).replace_schema_metadata({"freescale.num_items": "50"})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=10)
    errors = run_ranks(_bad_rank, 2, str(tmp_path), timeout=120)
    want = f"{tmp_path / 'a.parquet'}: row group 0, row 2: items value 90 is outside 0..49"
    assert errors[0] == errors[1] and errors[0].startswith(want), errors
