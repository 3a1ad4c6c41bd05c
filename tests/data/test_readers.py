import pytest
import torch

from freescale.data import (
    DataFormatError,
    SequenceSampling,
    SequenceSource,
    open_source,
    read_movielens,
    read_sasrec,
)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_sasrec_histories_keep_file_order_and_remap_items(tmp_path):
    path = write(tmp_path, "seq.txt", "1 10\n1 20\n2 20\n\n1 30\n2 40\n")
    ds = read_sasrec(path)
    assert ds.num_items == 4
    assert [u.items.tolist() for u in ds.users] == [[0, 1, 2], [1, 3]]


def test_movielens_dat_sorted_by_time_with_ratings_as_actions(tmp_path):
    path = write(tmp_path, "ratings.dat", "1::50::4::300\n1::60::5::100\n2::50::3::200\n")
    ds = read_movielens(path)
    first = ds.users[0]
    assert first.timestamps.tolist() == [100, 300]
    assert first.actions.tolist() == [10, 8]  # ratings in half stars
    assert ds.num_actions == 11
    assert first.items.tolist() == [1, 0]  # movie 60 then 50; 50 was seen first -> id 0


def test_movielens_csv(tmp_path):
    path = write(
        tmp_path,
        "ratings.csv",
        "userId,movieId,rating,timestamp\n7,1,3.5,10\n7,2,4.0,5\n8,1,1.0,1\n",
    )
    ds = read_movielens(path)
    assert [u.items.tolist() for u in ds.users] == [[1, 0], [0]]
    assert ds.users[0].actions.tolist() == [8, 7]


@pytest.mark.parametrize(
    "reader,name,text,line,why",
    [
        (read_sasrec, "s.txt", "1 2\n1 2 3\n", 2, "expected 'user item'"),
        (read_sasrec, "s.txt", "1 2\nx 3\n", 2, "user 'x' is not a non-negative integer"),
        (read_sasrec, "s.txt", "1 2\n1 -3\n", 2, "item '-3' is not a non-negative integer"),
        (read_sasrec, "s.txt", "1 +3\n", 1, "item '+3' is not a non-negative integer"),
        (read_sasrec, "s.txt", "1 2\n1 \u0663\n", 2, "item '\u0663' is not a non-negative"),
        (read_movielens, "ratings.dat", "1::2::nan::4\n", 1, "rating 'nan' is not a star"),
        (read_movielens, "ratings.dat", "1::2::inf::4\n", 1, "rating 'inf' is not a star"),
        (read_movielens, "ratings.dat", "1::2::6::4\n", 1, "rating '6' is not a star"),
        (read_movielens, "ratings.dat", "1::2::3.3::4\n", 1, "rating '3.3' is not a star"),
        (read_movielens, "ratings.dat", "1::2::3::4\n1::2::3\n", 2, "expected 4 fields"),
        (read_movielens, "ratings.dat", "1::2::good::4\n", 1, "rating 'good' is not a number"),
        (read_movielens, "ratings.csv", "user,movie\n", 1, "MovieLens csv header"),
        (
            read_movielens,
            "ratings.csv",
            "userId,movieId,rating,timestamp\n1,2,3,t\n",
            2,
            "timestamp 't'",
        ),
    ],
)
def test_malformed_lines_name_file_and_line(tmp_path, reader, name, text, line, why):
    path = write(tmp_path, name, text)
    with pytest.raises(DataFormatError) as err:
        reader(path)
    assert f"{path}:{line}:" in str(err.value) and why in str(err.value)


def test_ids_are_integers_bom_skipped(tmp_path):
    path = tmp_path / "s.txt"
    path.write_bytes("\ufeff1 10\n01 010\n1 7\n".encode())
    ds = read_sasrec(path)
    assert [u.items.tolist() for u in ds.users] == [[0, 0, 1]]  # 10 == 010; user 1 == 01


def test_non_utf8_bytes_name_the_line(tmp_path):
    path = tmp_path / "s.txt"
    path.write_bytes(b"1 2\n1 \xff3\n")
    with pytest.raises(DataFormatError, match=r"s.txt:2: not UTF-8 text \(byte 0xff at column 3\)"):
        read_sasrec(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(DataFormatError, match="no such file"):
        read_sasrec(tmp_path / "none.txt")
    with pytest.raises(DataFormatError, match="is a directory"):
        read_movielens(tmp_path)


def test_sequence_samples_prefix_then_next_items(tmp_path):
    lines = "".join(f"{u} {i}\n" for u in range(1, 5) for i in range(10 * u, 10 * u + 6))
    ds = read_sasrec(write(tmp_path, "s.txt", lines))
    sampling = SequenceSampling(
        max_uih=3, num_positives=1, num_negatives=2, samples_per_user=2, holdout=0
    )
    src = SequenceSource(ds, sampling)
    assert len(src) == 8 and src.steps_per_epoch(world_size=2, batch_size=2) == 2
    b = src.batch(step=0, rank=0, world_size=2, batch_size=2)
    b.validate()
    assert b.uih_lengths().tolist() == [3, 3]
    assert b.num_candidates().tolist() == [3, 3]
    assert b.labels.sum().item() == 2.0  # one positive per sample
    # the positive candidate is the item right after the UIH
    for i in range(2):
        _, u1 = b.uih.offsets[i : i + 2].tolist()
        c0, c1 = b.candidates.offsets[i : i + 2].tolist()
        pos = b.candidates["item_ids"][c0:c1][b.labels[c0:c1] == 1]
        assert int(pos) == int(b.uih["item_ids"][u1 - 1]) + 1
    with pytest.raises(ValueError, match="outside this dataset"):
        src.batch(step=-1, rank=0, world_size=2, batch_size=2)


def test_short_histories_yield_no_sample(tmp_path):
    ds = read_sasrec(write(tmp_path, "s.txt", "1 5\n2 6\n2 7\n"))
    src = SequenceSource(ds, SequenceSampling(num_negatives=0, holdout=0))
    assert len(src) == 1
    assert torch.equal(src.batch(0, 0, 1, 1).candidates["item_ids"], torch.tensor([2]))


def test_open_source_rejects_unknown_specs():
    with pytest.raises(ValueError, match="unknown data source"):
        open_source("hdf5:/x")
