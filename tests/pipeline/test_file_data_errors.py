"""Malformed file data fails before training: one line naming file and line, rc 2."""

import pytest

from freescale.cli.main import main


def _train(capsys, data: str, *extra: str) -> tuple[int, str]:
    rc = main(["train", "--set", f"data={data}", "--set", "run.steps=8", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one line, no traceback
    return rc, err[0]


@pytest.mark.parametrize(
    "name,content,message",
    [
        ("bad.txt", b"1 2\n1 \xfe3\n", "bad.txt:2: not UTF-8 text (byte 0xfe at column 3)"),
        ("signed.txt", b"1 2\n1 -3\n", "signed.txt:2: item '-3' is not a non-negative integer"),
        ("ratings.dat", b"1::2::4::5\n1::3::nan::6\n", "ratings.dat:2: rating 'nan' is not a star"),
        ("ratings.dat", b"1::2::inf::5\n", "ratings.dat:1: rating 'inf' is not a star"),
        ("small.txt", b"1 1\n1 2\n1 3\n1 4\n2 1\n", "do not fill one global batch of world size 2"),
        ("short.txt", b"1 1\n2 2\n", "0 training samples (from 2 users, 2 too short)"),
    ],
)
def test_bad_file_data_is_one_line_rc2(capsys, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_bytes(content)
    kind = "movielens" if name.startswith("ratings") else "sasrec"
    rc, line = _train(capsys, f"{kind}:{path}")
    assert rc == 2 and line.startswith("freescale: error:") and message in line, line


def test_missing_path_directory_and_zero_max_uih(capsys, tmp_path):
    rc, line = _train(capsys, f"sasrec:{tmp_path / 'none.txt'}")
    assert rc == 2 and "does not exist or is not a file" in line
    rc, line = _train(capsys, f"sasrec:{tmp_path}")
    assert rc == 2 and "does not exist or is not a file" in line
    (tmp_path / "ok.txt").write_text("".join(f"{u} {i}\n" for u in range(9) for i in range(6)))
    rc, line = _train(capsys, f"sasrec:{tmp_path / 'ok.txt'}", "--set", "data.max_uih=0")
    assert rc == 2 and "max_uih must be >= 1, got 0" in line


def test_parquet_without_pyarrow_or_bad_rows(capsys, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "u.parquet"
    pq.write_table(pa.table({"items": [[1, 2, 3, 4], [5, -6]]}), path)
    rc, line = _train(capsys, f"parquet:{path}")
    assert rc == 2 and "u.parquet: row 2: negative item -6" in line, line
