"""Training on ``parquet-stream`` data with 2 gloo ranks: a run stopped and resumed
at the same world size trains on exactly the uninterrupted run's samples, with
bit-identical losses; another world size is refused at start."""

import pytest
import torch

from freescale.data.parquet_stream import split_sample_id
from freescale.pipeline.checkpoint import PREFIX
from freescale.pipeline.config import build_config
from freescale.pipeline.train import Trainer
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


def _resume_rank(data: str, ckdir: str) -> dict:
    data_keys = [f"data=parquet-stream:{data}", "data.shuffle_buffer=60", "evaluation.every=5"]
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


def test_resume_at_the_same_world_size_is_exact(tmp_path):
    write_logs(tmp_path / "data", files=3, users=200, row_group=25)
    per_rank = run_ranks(_resume_rank, 2, str(tmp_path / "data"), str(tmp_path / "ck"), timeout=240)
    for out in per_rank:
        full = dict(out["full"])
        assert [s for s, _ in out["resumed"]] == list(range(5, 10))
        for step, loss in out["resumed"]:
            assert full[step] == loss, step  # bit-identical
        assert out["resumed_ids"] == out["full_ids"]
    ids = [i for out in per_rank for i in out["first_ids"] + out["full_ids"]]
    assert len(set(ids)) == len(ids)  # 10 steps x 2 ranks: less than an epoch, no repeat
    assert len({f for f, _, _ in ids}) > 1  # the shares mix the files


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
