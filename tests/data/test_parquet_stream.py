"""``parquet-stream``: disjoint shares per rank, a shuffled stream that is a pure
function of the step (exact resume), one-line errors naming file, row group, column.
Resume at another world size: tests/data/test_stream_resume.py."""

import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from freescale.data import DataFormatError, SequenceSampling, SyntheticConfig, open_source
from freescale.data.parquet_stream import split_sample_id
from freescale.data.sequences import training_targets
from freescale.jagged.batch import CAND_IDS, UIH_IDS

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

ROOT = Path(__file__).resolve().parents[2]
B = 3
L = [1, 2, 3, 4]  # a row long enough for a training target


def write_logs(dst: Path, files: int = 3, users: int = 30, row_group: int = 4) -> list[list]:
    """``files`` Parquet files of ``users`` rows each (items as given, below 50);
    returns each file's rows as (items, timestamps)."""
    dst.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    out = []
    for k in range(files):
        rows = []
        for _ in range(users):
            n = int(rng.integers(1, 9))
            rows.append((rng.integers(0, 50, n).tolist(), rng.permutation(n).tolist()))
        table = pa.table(
            {"items": [r[0] for r in rows], "timestamps": [r[1] for r in rows]}
        ).replace_schema_metadata({"freescale.num_items": "50"})
        pq.write_table(table, dst / f"part-{k}.parquet", row_group_size=row_group)
        out.append(rows)
    return out


def _source(path, shuffle=True, num_items=2_000, **options):
    sampling = SequenceSampling(max_uih=4, samples_per_user=2, shuffle=shuffle, seed=3)
    synthetic = SyntheticConfig(num_items=num_items)  # where data.num_items arrives
    return open_source(f"parquet-stream:{path}", synthetic, sampling, options)


def _all_samples(files: list[list]) -> Counter:
    s = SequenceSampling(samples_per_user=2)
    return Counter(
        (f, r, k)
        for f, rows in enumerate(files)
        for r, (items, _) in enumerate(rows)
        for k in range(len(training_targets(len(items), s)))
    )


def _ids(source, steps, rank, world):
    return [
        split_sample_id(i)
        for s in steps
        for i in source.batch(s, rank, world, B).sample_id.tolist()
    ]


def test_an_epoch_deals_every_sample_to_exactly_one_rank(tmp_path):
    files = write_logs(tmp_path)
    want = _all_samples(files)
    source = _source(tmp_path, shuffle_buffer=6)
    seen = Counter()
    for rank in range(2):
        share = sum(source._count(p) for p in source.share(0, rank, 2).tolist())
        ids = _ids(source, range(-(-share // B)), rank, 2)[:share]
        seen.update(ids)
        assert len(set(ids)) == share  # no repeat within the rank's epoch
    assert seen == want


def test_samples_are_the_rows_in_time_order_with_the_in_memory_targets(tmp_path):
    files = write_logs(tmp_path, files=2)
    source = _source(tmp_path, shuffle_buffer=5)
    for rank in range(2):
        for step in range(4):
            batch = source.batch(step, rank, 2, B)
            uih = batch.uih[UIH_IDS].tolist()
            offsets = batch.uih.offsets.tolist()
            for j, sid in enumerate(batch.sample_id.tolist()):
                f, r, k = split_sample_id(sid)
                items, stamps = files[f][r]
                ordered = [items[i] for i in np.argsort(stamps, kind="stable")]
                t = training_targets(len(items), SequenceSampling(samples_per_user=2))[k]
                assert uih[offsets[j] : offsets[j + 1]] == ordered[max(0, t - 4) : t]


def test_the_stream_is_a_function_of_the_step(tmp_path):
    """Steps asked out of order, by a fresh source, by one resumed at the same
    world size: the same batches (what exact resume rests on)."""
    write_logs(tmp_path)
    first = _source(tmp_path, shuffle_buffer=6)
    want = {s: first.batch(s, 1, 2, B) for s in range(30)}  # several epochs
    again = _source(tmp_path, shuffle_buffer=6).with_segments([(0, 2)])  # resumed at 2 ranks
    for s in [25, 17, 29, 18, 2]:
        got = again.batch(s, 1, 2, B)
        assert got.sample_id.tolist() == want[s].sample_id.tolist()
        assert got.candidates[CAND_IDS].tolist() == want[s].candidates[CAND_IDS].tolist()
        assert got.uih[UIH_IDS].tolist() == want[s].uih[UIH_IDS].tolist()
        assert got.labels.tolist() == want[s].labels.tolist()


def test_epochs_reshuffle_and_shuffle_false_keeps_file_order(tmp_path):
    write_logs(tmp_path)
    source = _source(tmp_path)
    assert source.share(0, 0, 2).tolist() != source.share(1, 0, 2).tolist()
    ordered = _source(tmp_path, shuffle=False)
    assert ordered.share(0, 1, 3).tolist() == list(range(1, ordered.files.piece_rows.size, 3))
    ids = _ids(ordered, range(2), 0, 1)
    assert ids == sorted(ids)


def test_too_few_row_groups_is_one_line(tmp_path):
    write_logs(tmp_path, files=1, users=8, row_group=4)
    source = _source(tmp_path)
    with pytest.raises(ValueError, match="2 row groups for 3 ranks"):
        source.check_world(3, B)
    source.with_segments([(0, 2), (4, 1)]).check_world(1, B)  # resumed at another world size


def test_ids_features_and_metadata(tmp_path):
    table = pa.table(
        {
            "items": [[1, 2, 3, 4], [5, 6, 7]],
            "actions": [[0, 1, 2, 0], [1, 1, 1]],
            "shop": [[3, 3, 1, 0], [2, 2, 2]],
        }
    )
    pq.write_table(table, tmp_path / "a.parquet")
    source = _source(tmp_path / "a.parquet", num_items=8, features="shop:uih:4", num_actions=3)
    assert (source.num_items, source.num_actions) == (8, 3)  # no metadata: the options
    batch = source.batch(0, 0, 1, 2)
    assert batch.uih["shop"].numel() == batch.uih[UIH_IDS].numel()
    with pytest.raises(ValueError, match="uih-level with ROWS"):
        _source(tmp_path, features="shop:candidates:4")
    with pytest.raises(ValueError, match="shuffle_buffer must be an integer >= 1"):
        _source(tmp_path, shuffle_buffer=0)


@pytest.mark.parametrize(
    "table,options,message",
    [
        ({"item": [[1]]}, {}, r"a.parquet: no 'items' column"),
        ({"items": [[1.5]]}, {}, r"a.parquet: column 'items' is list<element: double>"),
        ({"items": [1]}, {}, r"column 'items' is int64, not a list of integers"),
        ({"items": [L], "actions": [[0]]}, {}, r"row group 0, row 0: actions has 1 values, items"),
        ({"items": [L, [60, *L]]}, {}, r"row group 0, row 1: items value 60 is outside 0..49"),
        ({"items": [L, [-1, *L]]}, {}, r"row group 0, row 1: negative item -1"),
        ({"items": [L], "actions": [[0, 0, 9, 0]]}, {"num_actions": 4}, r"actions value 9"),
        ({"items": [L, None]}, {}, r"row 1: items is empty \(null\)"),
    ],
)
def test_bad_data_is_one_line_naming_file_row_group_and_column(tmp_path, table, options, message):
    pq.write_table(
        pa.table(table).replace_schema_metadata({"freescale.num_items": "50"}),
        tmp_path / "a.parquet",
    )
    with pytest.raises(DataFormatError, match=message) as e:
        _source(tmp_path, shuffle=False, **options).batch(0, 0, 1, 1)
    assert "\n" not in str(e.value)


def test_missing_and_unreadable_files_are_one_line(tmp_path):
    with pytest.raises(DataFormatError, match="no such file or directory"):
        _source(tmp_path / "nope")
    with pytest.raises(DataFormatError, match="no Parquet file"):
        _source(tmp_path)
    with pytest.raises(DataFormatError, match="matches no file"):
        _source(tmp_path / "*.parquet")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataFormatError, match=r"bad\.parquet: ") as e:
        _source(tmp_path / "*.parquet")
    assert "\n" not in str(e.value)


def test_the_generator_writes_what_the_stream_reads(tmp_path):
    out = subprocess.run(
        [sys.executable, ROOT / "scripts/make_taste_data.py", tmp_path / "d", "--users", "60",
         "--files", "3", "--row-group", "8", "--items", "100"],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    assert '"row_groups": 9' in out.stdout
    source = _source(tmp_path / "d")
    assert (source.num_items, source.num_actions, source.files.piece_rows.size) == (100, 4, 9)
    assert source.batch(0, 1, 2, B).batch_size == B
