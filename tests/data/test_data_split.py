"""``freescale data convert`` / ``data split`` and ``parquet-stream:`` on a split
directory: the validation and test users, their samples, the training samples
of an epoch, the popularity counts and the metrics of one model are those of
the in-memory ``sasrec:`` source of the same file."""

import json
import os
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from freescale.cli.main import main
from freescale.data import DataFormatError, SequenceSampling, open_source, read_sasrec
from freescale.data.parquet_stream import split_sample_id
from freescale.data.sequences import SPLITS
from freescale.data.split_source import SplitStreamSource
from freescale.data.stream_check import first_problem
from freescale.jagged.batch import CAND_IDS, UIH_IDS

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROOT = Path(__file__).resolve().parents[2]
SAMPLING = SequenceSampling(max_uih=3, samples_per_user=0, eval_negatives=20, seed=5)


def write_sasrec(path: Path, users: int = 40) -> Path:
    """Users of 1..12 events (short ones too), their lines interleaved, raw ids
    sparse: the reader's user order and item remapping are not the identity."""
    rng = np.random.default_rng(1)
    histories = {}
    for u in rng.permutation(users).tolist():
        n = (1, 2, 3)[u] if u < 3 else int(rng.integers(1, 13))
        histories[u * 7 + 3] = [1000 + 17 * int(i) for i in rng.integers(0, 40, n)]
    lines = []
    while any(histories.values()):
        for user, items in histories.items():  # round robin
            if items:
                lines.append(f"{user} {items.pop(0)}\n")
    path.write_text("".join(lines))
    return path


def cli(capsys, *args: str) -> tuple[int, dict | None, str]:
    """(exit status, the JSON line or None, stderr) of ``freescale ARGS``."""
    rc = main([str(a) for a in args])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return rc, json.loads(lines[-1]) if rc == 0 and lines else None, captured.err


@pytest.fixture
def split_dir(tmp_path, capsys):
    """(the SASRec file, its conversion, the split of that)."""
    text = write_sasrec(tmp_path / "s.txt")
    conv, dst = tmp_path / "conv", tmp_path / "split"
    assert (
        cli(capsys, "data", "convert", f"sasrec:{text}", conv, "--files", 3, "--row-group", 4)[0]
        == 0
    )
    assert cli(capsys, "data", "split", conv, dst)[0] == 0
    return text, conv, dst


def assert_same_batch(a, b) -> None:
    assert torch.equal(a.sample_id, b.sample_id) and torch.equal(a.labels, b.labels)
    for x, y in ((a.uih, b.uih), (a.candidates, b.candidates), (a.content, b.content)):
        assert torch.equal(x.offsets, y.offsets) and x.features.keys() == y.features.keys()
        for name in x.features:
            assert torch.equal(x[name], y[name]), name


def assert_same_evaluation(memory, split, world, batch_size):
    """Every validation and test batch of every rank, in memory and on the split."""
    for name in SPLITS:
        for step in range(memory.eval_steps(world, batch_size)):
            for rank in range(world):
                a = memory.eval_batch(name, step, rank, world, batch_size)
                assert_same_batch(a, split.eval_batch(name, step, rank, world, batch_size))


def test_convert_writes_the_readers_users_in_order_with_its_ids(split_dir):
    text, conv, _ = split_dir
    ds = read_sasrec(text)
    table = pq.read_table(conv)
    parts = [f"part-0000{k}.parquet" for k in range(3)]
    assert sorted(p.name for p in conv.iterdir()) == ["_ids", *parts]
    # the raw id of each row, once, beside the parts (the listing of parts skips `_` names)
    raw = np.load(conv / "_ids" / "items.npy", allow_pickle=False)
    assert raw.tolist() == ds.item_ids.tolist() and raw.tolist() != list(range(raw.size))
    assert table.column("user_id").to_pylist() == list(range(len(ds.users)))
    assert table.column("items").to_pylist() == [h.items.tolist() for h in ds.users]
    assert table.column("timestamps").to_pylist() == [h.timestamps.tolist() for h in ds.users]
    meta = pq.read_schema(conv / "part-00000.parquet").metadata
    assert meta[b"freescale.num_items"] == str(ds.num_items).encode()
    assert meta[b"freescale.num_actions"] == b"1"
    assert pq.ParquetFile(conv / "part-00000.parquet").metadata.row_group(0).num_rows == 4


def test_the_split_keeps_the_id_map_and_the_stream_reads_it(split_dir):
    text, conv, dst = split_dir
    kept = np.load(dst / "_ids" / "items.npy", allow_pickle=False)
    assert kept.tolist() == read_sasrec(text).item_ids.tolist()
    stream = open_source(f"parquet-stream:{dst}", sampling=SAMPLING)
    assert stream.id_maps["items"].tolist() == kept.tolist()
    assert open_source(f"parquet-stream:{conv}", sampling=SAMPLING).id_maps["items"].size


def test_split_files_hold_train_prefixes_and_targets_last(split_dir):
    text, conv, dst = split_dir
    ds = read_sasrec(text)
    train = pq.read_table(dst / "train").to_pydict()
    valid = pq.read_table(dst / "validation").to_pydict()
    test = pq.read_table(dst / "test").to_pydict()
    full = [h.items.tolist() for h in ds.users]
    assert train["items"] == [h[:-2] if len(h) >= 3 else [] for h in full]
    kept = [u for u, h in enumerate(full) if len(h) >= 3]
    assert valid["user_id"] == test["user_id"] == kept and 0 < len(kept) < len(full)
    assert valid["items"] == [full[u][:-1] for u in kept]
    assert valid["later_items"] == [full[u][-1:] for u in kept]
    assert test["items"] == [full[u] for u in kept]
    for k in range(3):  # SRC's row groups, one at a time
        groups = pq.ParquetFile(conv / f"part-0000{k}.parquet").metadata.num_row_groups
        assert (
            pq.ParquetFile(dst / "train" / f"part-0000{k}.parquet").metadata.num_row_groups
            == groups
        )
    marker = json.loads((dst / "_split.json").read_text())
    assert marker["users"] == len(full) and marker["eval_users"] == len(kept)


def test_evaluation_batches_counts_and_popularity_equal_the_in_memory_ones(split_dir):
    text, _, dst = split_dir
    memory = open_source(f"sasrec:{text}", None, SAMPLING)
    split = open_source(f"parquet-stream:{dst}", None, SAMPLING)
    assert isinstance(split, SplitStreamSource) and not split.no_evaluation
    assert (split.num_items, split.num_actions) == (memory.num_items, memory.num_actions)
    assert split.split_counts() == memory.split_counts()
    assert np.array_equal(split.popularity(), memory.popularity())
    for world, batch in ((1, 64), (2, 4), (3, 5)):
        assert split.eval_steps(world, batch) == memory.eval_steps(world, batch)
        for name in SPLITS:
            for step in range(memory.eval_steps(world, batch) + 1):  # + 1: empty batches
                for rank in range(world):
                    a = memory.eval_batch(name, step, rank, world, batch)
                    assert_same_batch(a, split.eval_batch(name, step, rank, world, batch))


def _movielens(tmp_path: Path) -> tuple[str, dict, list[str]]:
    rng = np.random.default_rng(2)
    lines = [
        f"{u}::{int(rng.integers(1, 60)) * 3}::{int(rng.integers(1, 11)) / 2}::{int(t)}\n"
        for u in range(1, 25)
        for t in rng.permutation(int(rng.integers(1, 9)))
    ]
    (tmp_path / "ratings.dat").write_text("".join(lines))
    return f"movielens:{tmp_path / 'ratings.dat'}", {}, []


def _parquet_with_feature(tmp_path: Path) -> tuple[str, dict, list[str]]:
    rng = np.random.default_rng(3)
    rows = [int(rng.integers(1, 9)) for _ in range(25)]
    table = pa.table(
        {
            "items": [(rng.integers(0, 30, n) * 11 + 5).tolist() for n in rows],
            "timestamps": [rng.integers(0, 4, n).tolist() for n in rows],  # ties, unsorted
            "cat": [rng.integers(0, 6, n).tolist() for n in rows],
        }
    )
    pq.write_table(table, tmp_path / "u.parquet")
    return f"parquet:{tmp_path / 'u.parquet'}", {"features": "cat:uih"}, ["--features", "cat:uih"]


@pytest.mark.parametrize("make", [_movielens, _parquet_with_feature])
def test_other_readers_convert_and_split_with_their_actions_and_features(tmp_path, capsys, make):
    spec, options, flags = make(tmp_path)
    conv, dst = tmp_path / "conv", tmp_path / "split"
    assert (
        cli(capsys, "data", "convert", spec, conv, "--files", 2, "--row-group", 3, *flags)[0] == 0
    )
    assert cli(capsys, "data", "split", conv, dst)[0] == 0
    meta = pq.read_schema(dst / "test" / "part-00000.parquet").metadata
    stream_options = {"features": meta[b"freescale.features"].decode()} if options else {}
    memory = open_source(spec, None, SAMPLING, options)
    split = open_source(f"parquet-stream:{dst}", None, SAMPLING, stream_options)
    assert (split.num_items, split.num_actions) == (memory.num_items, memory.num_actions)
    assert split.schema == memory.schema
    assert split.split_counts() == memory.split_counts()
    assert np.array_equal(split.popularity(), memory.popularity())
    assert_same_evaluation(memory, split, 2, 3)


@pytest.mark.parametrize("per_user,stride", [(0, 1), (2, 2)])
def test_an_epoch_of_the_stream_trains_on_the_in_memory_samples(split_dir, per_user, stride):
    """(user, UIH, positive) of every training sample of one epoch, dealt to 2 ranks."""
    text, _, dst = split_dir
    s = replace(SAMPLING, samples_per_user=per_user, stride=stride, shuffle=True)
    memory = open_source(f"sasrec:{text}", None, s)
    want = Counter()
    for p in range(len(memory)):
        u, _ = memory.sample_at(p)
        sample = memory.raw_sample(p)
        want[(u, tuple(sample.uih_ids.tolist()), int(sample.cand_ids[sample.labels == 1][0]))] += 1
    split = open_source(f"parquet-stream:{dst}", None, s, {"shuffle_buffer": 5})
    users = [
        pq.read_table(p).column("user_id").to_pylist() for p in sorted((dst / "train").iterdir())
    ]
    got = Counter()
    for rank in range(2):
        share = sum(split._count(p) for p in split.share(0, rank, 2).tolist())
        for q in range(share):
            sid, sample = split.sample_at(q, rank, 2)
            f, row, _ = split_sample_id(sid)
            positive = int(sample.cand_ids[sample.labels == 1][0])
            got[(users[f][row], tuple(sample.uih_ids.tolist()), positive)] += 1
    assert got == want and sum(got.values()) == len(memory) > 0


def test_one_trained_model_scores_the_same_on_the_split_and_in_memory(split_dir):
    """Train 2 steps on the split (the trainer evaluates it), then the plain
    model on both sources: the same users, HR@10, NDCG@10, popularity baseline."""
    import freescale
    from freescale.config import build_config
    from freescale.data.source import schema_of
    from freescale.pipeline.evaluation import evaluate_split, popularity_baseline
    from freescale.pipeline.setup import build_model

    text, _, dst = split_dir
    keys = [
        f"data=parquet-stream:{dst}", "data.samples_per_user=0", "data.eval_negatives=20",
        "data.max_uih=3", "run.nproc=1", "run.steps=2", "run.warmup=1", "run.batch_size=8",
        "run.device=cpu", "evaluation.every=2", "output.progress=false",
    ]  # fmt: skip
    cfg = build_config("demo", keys)
    result = freescale.train(config=cfg, state_dict=True)
    final = result.summary["eval"]
    s = replace(SAMPLING, seed=0)
    memory = open_source(f"sasrec:{text}", None, s)
    split = open_source(f"parquet-stream:{dst}", None, s)
    model = build_model(cfg.model, schema_of(split))
    model.load_state_dict(result.state_dict)
    model.eval()
    cpu = torch.device("cpu")
    for name in SPLITS:
        on_split = evaluate_split(model, split, name, 0, 1, 64, cpu)
        in_memory = evaluate_split(model, memory, name, 0, 1, 64, cpu)
        assert on_split == in_memory
        assert on_split["users"] == len(memory.eval_users) == final[name]["users"]
        for key in ("hr@10", "ndcg@10"):
            assert final[name][key] == pytest.approx(in_memory[key], abs=1e-9), (name, key)
    assert popularity_baseline(split, "test") == popularity_baseline(memory, "test")
    assert final["popularity_test"] == popularity_baseline(memory, "test")
    assert final["data"] == memory.split_counts()


@pytest.mark.slow
def test_two_ranks_train_on_the_split_and_eval_reloads_the_checkpoint(split_dir, tmp_path, capsys):
    """The CLI at 2 ranks (each evaluates its share of the users): the summary's
    users, counts and popularity baseline are the in-memory ones, and
    ``freescale eval`` of the checkpoint gives the summary's metrics again."""
    from freescale.pipeline.evaluation import popularity_baseline

    text, _, dst = split_dir
    ck = tmp_path / "ck"
    keys = [
        f"data=parquet-stream:{dst}", "data.samples_per_user=0", "data.eval_negatives=20",
        "data.max_uih=3", "run.nproc=2", "run.steps=6", "run.warmup=1", "run.batch_size=4",
        "evaluation.every=3", "output.progress=false", f"checkpoint.dir={ck}", "checkpoint.every=6",
    ]  # fmt: skip
    rc, summary, err = cli(capsys, "train", *[a for k in keys for a in ("--set", k)])
    assert rc == 0, err
    memory = open_source(f"sasrec:{text}", None, SAMPLING)
    final = summary["eval"]
    assert final["valid"]["users"] == final["test"]["users"] == len(memory.eval_users)
    assert final["data"] == memory.split_counts()
    assert final["popularity_test"] == popularity_baseline(memory, "test")
    rc, again, err = cli(capsys, "eval", ck)
    assert rc == 0, err
    assert again["eval"] == final


def test_data_stats_streams_a_split_and_a_plain_stream(split_dir, capsys):
    text, conv, dst = split_dir
    counts = open_source(f"sasrec:{text}", None, SAMPLING).split_counts()
    for path in (dst, conv):
        rc, out, _ = cli(
            capsys, "data", "stats", "--source", f"parquet-stream:{path}", "--max-uih", "2,3",
            "--batch-size", "4", "--world-size", "2", "--steps", "3",
        )  # fmt: skip
        assert rc == 0 and out["steps"] == {"4": 3} and len(out["rows"]) == 2
        assert out["split"] == {**counts, "train_samples": out["split"]["train_samples"]}
        assert out["coverage"]["4"]["samples_read"] == 24


def test_without_a_split_directory_the_stream_still_skips_evaluation(split_dir):
    _, conv, dst = split_dir
    assert open_source(f"parquet-stream:{conv}").no_evaluation
    with pytest.raises(ValueError, match="is the train part of a split"):
        open_source(f"parquet-stream:{dst / 'train'}")


def _one_error(capsys, *args) -> str:
    rc, _, err = cli(capsys, *args)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("freescale: error: "), err
    return lines[0]


def test_bad_inputs_are_one_line_errors(split_dir, tmp_path, capsys):
    text, conv, dst = split_dir
    missing = tmp_path / "nope.txt"
    assert "no such file" in _one_error(
        capsys, "data", "convert", f"sasrec:{missing}", tmp_path / "x"
    )
    assert "no such file" in _one_error(capsys, "data", "split", missing, tmp_path / "x")
    assert "reads sasrec:PATH" in _one_error(capsys, "data", "convert", str(text), tmp_path / "x")
    assert "not empty" in _one_error(capsys, "data", "convert", f"sasrec:{text}", conv)
    assert "not empty" in _one_error(capsys, "data", "split", conv, dst)
    assert "already a split" in _one_error(capsys, "data", "split", dst, tmp_path / "x")
    assert "contain each other" in _one_error(capsys, "data", "split", conv, conv / "sub")
    assert "is the train part" in _one_error(capsys, "data", "split", dst / "train", tmp_path / "x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    err = _one_error(capsys, "data", "split", conv, tmp_path / "other", "--force")
    assert "also holds 'notes.txt'" in err and (tmp_path / "other" / "notes.txt").exists()
    # --force replaces an earlier output, exactly
    before = {p: p.read_bytes() for p in dst.rglob("*.parquet")}
    assert cli(capsys, "data", "split", conv, dst, "--force")[0] == 0
    assert {p: p.read_bytes() for p in dst.rglob("*.parquet")} == before


def test_split_checks_rows_and_needs_num_items(tmp_path, capsys):
    rows = [[1, 2, 3, 4]] * 6
    rows[4] = [1, 2, 90, 4]
    pq.write_table(pa.table({"items": rows}), tmp_path / "a.parquet", row_group_size=3)
    err = _one_error(capsys, "data", "split", tmp_path / "a.parquet", tmp_path / "x")
    assert "no freescale.num_items metadata: give --num-items" in err
    err = _one_error(
        capsys, "data", "split", tmp_path / "a.parquet", tmp_path / "x", "--num-items", "50"
    )
    assert err.endswith("a.parquet: row group 1, row 4: items value 90 is outside 0..49 "
                        "(--num-items / freescale.num_items)")  # fmt: skip
    table = pa.table({"items": [[1, 2, 3]], "timestamps": [[5, 6]]})
    pq.write_table(table, tmp_path / "b.parquet")
    err = _one_error(
        capsys, "data", "split", tmp_path / "b.parquet", tmp_path / "y", "--num-items", "9"
    )
    assert err.endswith("row group 0, row 0: timestamps has 2 values, items has 3")


@pytest.mark.parametrize(
    "column, bad",
    [
        ("actions", [0, 5000, 1]),
        ("timestamps", [1, -4, 2]),
        ("items", [1, None, 3]),
        ("cat", [0, -1, 2]),
    ],
)
def test_split_and_the_stream_name_a_bad_row_with_one_line(tmp_path, capsys, column, bad):
    """One row checker (`freescale.data.rows`): the line data split fails with is the
    stream's check's for the same file."""
    data = {c: [[1, 2, 3]] * 4 for c in ("items", "actions", "timestamps", "cat")}
    data["actions"] = [[0, 0, 0]] * 4
    data[column] = [*data[column][:3], bad]
    table = pa.table(data).replace_schema_metadata({"freescale.num_items": "9"})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    err = _one_error(capsys, "data", "split", tmp_path / "a.parquet", tmp_path / "x")
    stream = open_source(
        f"parquet-stream:{tmp_path / 'a.parquet'}", options={"features": "cat:uih:9"}
    )
    line = first_problem(stream)
    assert "row group 1, row 3: " in line and err == f"freescale: error: {line}"


def test_held_out_rows_are_checked_with_one_line_naming_the_row(tmp_path, capsys):
    table = pa.table({"items": [[1, 2, 3, 4]] * 3})
    pq.write_table(table.replace_schema_metadata({"freescale.num_items": "9"}), tmp_path / "a")
    assert cli(capsys, "data", "split", tmp_path / "a", tmp_path / "s")[0] == 0
    part = tmp_path / "s" / "validation" / "part-00000.parquet"
    valid = pq.read_table(part)

    def first_error(column: str, row: int, value: list) -> str:
        values = valid.column(column).to_pylist()
        values[row] = value
        bad = valid.set_column(valid.schema.get_field_index(column), column, [values])
        pq.write_table(bad.replace_schema_metadata(valid.schema.metadata), part)
        source = open_source(f"parquet-stream:{tmp_path / 's'}")
        with pytest.raises(DataFormatError) as e:
            source.eval_batch("valid", 0, 0, 1, 4)
        return str(e.value)

    assert first_error("items", 1, [1, 12, 3]).endswith(
        "part-00000.parquet: row group 0, row 1: items value 12 is outside 0..8 "
        "(data.num_items / freescale.num_items)"
    )
    assert first_error("later_items", 2, [4, 4]).endswith(
        "row group 0, row 2: later_items is not one item id in 0..8: "
        "not a row of freescale data split"
    )


def test_split_sorts_events_by_timestamp_and_carries_other_columns(tmp_path, capsys):
    table = pa.table(
        {
            "user_id": ["a", "b"],
            "items": [[5, 6, 7, 8], [1, 2]],
            "timestamps": [[30, 10, 20, 10], [2, 1]],
            "cat": [[0, 1, 2, 3], [4, 5]],
        }
    ).replace_schema_metadata({"freescale.num_items": "10"})
    pq.write_table(table, tmp_path / "a.parquet")
    assert cli(capsys, "data", "split", tmp_path / "a.parquet", tmp_path / "s")[0] == 0
    test = pq.read_table(tmp_path / "s" / "test").to_pydict()
    assert test["user_id"] == ["a"] and test["items"] == [[6, 8, 7, 5]]  # stable by time
    assert test["cat"] == [[1, 3, 2, 0]] and test["timestamps"] == [[10, 10, 20, 30]]
    train = pq.read_table(tmp_path / "s" / "train").to_pydict()
    assert train["items"] == [[6, 8], []] and train["user_id"] == ["a", "b"]
    source = open_source(f"parquet-stream:{tmp_path / 's'}", options={"features": "cat:uih:6"})
    batch = source.eval_batch("valid", 0, 0, 1, 4)
    assert batch.uih[UIH_IDS].tolist() == [6, 8] and batch.uih["cat"].tolist() == [1, 3]
    assert batch.candidates[CAND_IDS][0] == 7 and 5 not in batch.candidates[CAND_IDS].tolist()


@pytest.mark.slow
def test_beauty_converted_and_split_evaluates_like_the_in_memory_file(tmp_path, capsys):
    """The public Beauty file ($FREESCALE_BEAUTY): every validation and test sample,
    the counts and the popularity baseline equal the in-memory path's."""
    beauty = Path(os.environ.get("FREESCALE_BEAUTY", "beauty.txt"))
    if not beauty.is_file():
        pytest.skip("set FREESCALE_BEAUTY to the Amazon Beauty SASRec file")
    conv, dst = tmp_path / "conv", tmp_path / "split"
    assert (
        cli(capsys, "data", "convert", f"sasrec:{beauty}", conv, "--files", 4, "--row-group", 2000)[
            0
        ]
        == 0
    )
    assert cli(capsys, "data", "split", conv, dst)[0] == 0
    s = SequenceSampling(max_uih=50, samples_per_user=0)
    memory = open_source(f"sasrec:{beauty}", None, s)
    split = open_source(f"parquet-stream:{dst}", None, s)
    assert split.split_counts() == memory.split_counts()
    assert split.split_counts()["eval_users"] == 22_363
    assert np.array_equal(split.popularity(), memory.popularity())
    assert_same_evaluation(memory, split, 2, 512)
