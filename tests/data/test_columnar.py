"""Columnar user histories (Parquet, list-CSV) through the optional pyarrow."""

import pytest

from freescale.data import DataFormatError, open_source, read_sasrec
from freescale.data.columnar import read_columns

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def test_parquet_and_csv_match_the_sasrec_reader(tmp_path):
    rows = [[10, 20, 30], [20, 40], [50, 10, 10, 60]]
    pq.write_table(pa.table({"user": [1, 2, 3], "items": rows}), tmp_path / "u.parquet")
    (tmp_path / "u.csv").write_text(
        "user,items\n" + "".join(f"{u},{' '.join(map(str, r))}\n" for u, r in enumerate(rows, 1))
    )
    (tmp_path / "u.txt").write_text("".join(f"{u} {i}\n" for u, r in enumerate(rows, 1) for i in r))
    want = [u.items.tolist() for u in read_sasrec(tmp_path / "u.txt").users]
    for name in ("u.parquet", "u.csv"):
        ds = read_columns(tmp_path / name)
        assert [u.items.tolist() for u in ds.users] == want and ds.num_items == 6
    assert open_source(f"csv:{tmp_path / 'u.csv'}").num_items == 6


def test_actions_and_timestamps_sort_and_size_the_action_table(tmp_path):
    pq.write_table(
        pa.table({"items": [[1, 2, 3]], "actions": [[0, 7, 2]], "timestamps": [[30, 10, 20]]}),
        tmp_path / "a.parquet",
    )
    ds = read_columns(tmp_path / "a.parquet")
    assert ds.users[0].items.tolist() == [1, 2, 0]  # sorted by time; ids in first-seen order
    assert ds.users[0].actions.tolist() == [7, 2, 0] and ds.num_actions == 8


@pytest.mark.parametrize(
    "table,message",
    [
        (
            {"items": [[1], [2, 3]], "actions": [[0], [1]]},
            "row 2: actions has 1 values, items has 2",
        ),
        ({"items": [[1], None]}, "row 2: items is empty (null)"),
        ({"items": [[1.5]]}, "row 1: items value 1.5 is not an integer"),
        ({"items": [[1]], "actions": [[5000]]}, "row 1: action 5000 is outside 0..1023"),
        ({"things": [[1]]}, "no 'items' column"),
    ],
)
def test_bad_parquet_rows_are_named(tmp_path, table, message):
    pq.write_table(pa.table(table), tmp_path / "b.parquet")
    with pytest.raises(DataFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_columns(tmp_path / "b.parquet")


def test_bad_csv_list_value_names_the_line(tmp_path):
    (tmp_path / "b.csv").write_text("items\n1 2\n3 -4\n")
    with pytest.raises(DataFormatError, match=r"b.csv: row 3: items value '-4' is not"):
        read_columns(tmp_path / "b.csv")
