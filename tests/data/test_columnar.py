"""Columnar user histories (Parquet, list-CSV) through the optional pyarrow."""

import pytest

from freescale.data import DataFormatError, open_source, read_sasrec
from freescale.data.columnar import parse_features, read_columns
from freescale.data.source import schema_of

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


# ---- extra features: data.features=NAME:LEVEL[:ROWS] ----------------------------


def _write(tmp_path, table, name="f.parquet"):
    pq.write_table(pa.table(table), tmp_path / name)
    return tmp_path / name


def test_feature_columns_become_named_features_of_the_schema_and_batches(tmp_path):
    path = _write(
        tmp_path,
        {
            "items": [[10, 20, 30, 40], [20, 50, 10]],
            "cat": [[1, 2, 3, 4], [2, 5, 1]],  # a category per item: both levels
            "place": [[0, 0, 7, 1], [3, 2, 2]],  # where the event happened: uih only
        },
    )
    src = open_source(f"parquet:{path}", options={"features": "cat:uih,cat:candidates,place:uih:9"})
    schema = schema_of(src)
    assert schema.rows("uih", "cat") == 6 and schema.rows("candidates", "cat") == 6
    assert schema.rows("uih", "place") == 9  # ROWS given; else the largest value + 1
    assert [f.key for f in schema.extras()] == ["uih.cat", "candidates.cat", "uih.place"]
    batch = src.eval_batch("test", 0, 0, 1, 2)
    # the test targets are the last items: the histories before them
    assert batch.uih["cat"].tolist() == [1, 2, 3, 2, 5]
    assert batch.uih["place"].tolist() == [0, 0, 7, 3, 2]
    cat_of = {0: 1, 1: 2, 2: 3, 3: 4, 4: 5}  # remapped item -> its category
    assert batch.candidates["cat"].tolist() == [
        cat_of[i] for i in batch.candidates["item_ids"].tolist()
    ]
    assert "place" not in batch.candidates.features
    empty = src.eval_batch("test", 5, 0, 1, 2)  # past the last user: the features, empty
    assert empty.uih["cat"].numel() == 0 and empty.candidates["cat"].numel() == 0


def test_csv_feature_columns_match_parquet(tmp_path):
    rows, cats = [[10, 20, 30], [20, 40]], [[3, 1, 0], [1, 2]]
    pq_path = _write(tmp_path, {"items": rows, "cat": cats})
    csv_path = tmp_path / "f.csv"
    csv_path.write_text(
        "items,cat\n" + "".join(f"{' '.join(map(str, r))},{' '.join(map(str, c))}\n"
                                for r, c in zip(rows, cats, strict=True))
    )  # fmt: skip
    for path in (pq_path, csv_path):
        ds = read_columns(path, features="cat:uih")
        assert [u.features["cat"].tolist() for u in ds.users] == cats
        assert ds.features[0].rows == 4


def test_features_are_sorted_with_the_items_by_timestamp(tmp_path):
    path = _write(tmp_path, {"items": [[1, 2, 3]], "timestamps": [[30, 10, 20]], "c": [[7, 8, 9]]})
    ds = read_columns(path, features=["c:uih", "c:candidates"])
    assert ds.users[0].items.tolist() == [1, 2, 0] and ds.users[0].features["c"].tolist() == [
        8,
        9,
        7,
    ]
    assert ds.item_features["c"].tolist() == [7, 8, 9]  # item 0 (raw 1) has 7, ...


@pytest.mark.parametrize(
    "table,features,message",
    [
        (
            {"items": [[1, 2], [3, 4, 5]], "c": [[0, 1], [2, 3]]},
            "c:uih",
            "f.parquet: row 2: c has 2 values, items has 3",
        ),
        ({"items": [[1], [2]], "c": [[0], [9]]}, "c:uih:5", "row 2: c value 9 is outside 0..4"),
        ({"items": [[1], [2]], "c": [[0], [-1]]}, "c:uih", "row 2: c value -1 is negative"),
        ({"items": [[1]], "c": [[0.5]]}, "c:uih", "row 1: c value 0.5 is not an integer"),
        ({"items": [[1]], "c": [None]}, "c:uih", "row 1: c is empty (null)"),
        ({"items": [[1]]}, "c:uih", "no 'c' column"),
        (
            {"items": [[1, 2], [3, 1]], "c": [[4, 5], [6, 7]]},
            "c:candidates",
            "row 2: c 7 for item 1, which has c 4 in row 1 (a candidates-level feature is one",
        ),
    ],
)
def test_bad_feature_columns_are_one_line_naming_file_row_and_column(
    tmp_path, table, features, message
):
    path = _write(tmp_path, table)
    with pytest.raises(DataFormatError) as e:
        read_columns(path, features=features)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_bad_csv_feature_value_names_the_line(tmp_path):
    (tmp_path / "b.csv").write_text("items,c\n1 2,0 1\n3,x\n")
    with pytest.raises(DataFormatError, match=r"b.csv: row 3: c value 'x' is not an integer"):
        read_columns(tmp_path / "b.csv", features="c:uih")


@pytest.mark.parametrize(
    "spec,message",
    [
        ("c", "NAME:LEVEL[:ROWS]"),
        ("c:dense", "LEVEL: uih, candidates or content"),
        ("c:uih,c:content", "at level content holds a list per event"),
        ("content_ids:content", "standard column"),
        ("c:uih:0", "ROWS must be an integer >= 1"),
        ("c:uih:x", "ROWS must be an integer >= 1"),
        ("c:uih:3:4", "NAME:LEVEL[:ROWS]"),
        ("c:uih,c:uih", "names c:uih twice"),
        ("c:uih:3,c:candidates:4", "two different ROWS"),
        ("actions:uih", "standard column"),
        ("item_ids:candidates", "standard column"),
        (5, "NAME:LEVEL[:ROWS]"),
    ],
)
def test_bad_features_option_is_one_line(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_features(spec)


def test_builtin_sources_take_their_options_and_reject_others(tmp_path):
    path = _write(tmp_path, {"items": [[1, 2, 3]], "c": [[0, 1, 2]]})
    (tmp_path / "s.txt").write_text("1 1\n1 2\n1 3\n")
    with pytest.raises(ValueError, match=r"takes data.features; got data.featurs"):
        open_source(f"parquet:{path}", options={"featurs": "c:uih"})
    with pytest.raises(ValueError, match=r"takes no data.\* options; got data.features"):
        open_source(f"sasrec:{tmp_path / 's.txt'}", options={"features": "c:uih"})
    with pytest.raises(ValueError, match=r"'synthetic' takes no data.\* options; got data.x"):
        open_source("synthetic", options={"x": 1})
    assert schema_of(open_source(f"parquet:{path}")).extras() == ()  # columns not named: ignored
