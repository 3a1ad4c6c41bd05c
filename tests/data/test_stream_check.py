"""The check of every ``parquet-stream`` row before step 0 (`freescale.data.stream_check`):
on random corruptions it finds exactly the first problem the per-row reading
code (`ParquetStreamSource._histories`) raises, with the same line; ranks
share the pieces and agree on the first one in piece order."""

from functools import partial

import numpy as np
import pytest

from freescale.data import DataFormatError, SequenceSampling, SyntheticConfig, open_source
from freescale.data.rows import RowRules
from freescale.data.stream_check import check_rounds, first_problem, piece_problem, rounds
from freescale.testing import run_ranks

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

NUM_ITEMS, SHOP_ROWS = 50, 6
KINDS = (
    "length", "negative item", "item too large", "action negative", "action too large",
    "action beyond 1024", "negative timestamp", "unsorted timestamps", "null list",
    "null value", "shop too large", "shop negative", "empty row",
)  # fmt: skip


def _source(path, num_actions=None, shuffle=False, **options):
    sampling = SequenceSampling(max_uih=4, samples_per_user=2, shuffle=shuffle, seed=3)
    if num_actions is not None:
        options["num_actions"] = num_actions
    return open_source(f"parquet-stream:{path}", SyntheticConfig(), sampling, options)


def _rows(rng, n):
    rows = []
    for _ in range(n):
        k = int(rng.integers(0, 7))
        rows.append(
            {
                "items": rng.integers(0, NUM_ITEMS, k).tolist(),
                "actions": rng.integers(0, 4, k).tolist(),
                "timestamps": np.sort(rng.integers(0, 1000, k)).tolist(),
                "shop": rng.integers(0, SHOP_ROWS, k).tolist(),
            }
        )
    return rows


def _corrupt(rng, row, kind):
    """Apply one corruption (most are problems; unsorted timestamps and empty rows are not)."""
    n = len(row["items"])
    at = int(rng.integers(0, n)) if n else None

    def put(column, value):
        if row[column] is None:  # a null list stays null
            return
        if at is None or at >= len(row[column]):  # lengths differ then
            row[column] = [*row[column], value]
        else:
            row[column][at] = value

    if kind == "length":
        c = str(rng.choice(["actions", "timestamps", "shop"]))
        if rng.random() < 0.5 or not row[c]:
            row[c] = [*(row[c] or []), 0]
        else:
            row[c] = row[c][:-1]
    elif kind == "negative item":
        put("items", -int(rng.integers(1, 5)))
    elif kind == "item too large":
        put("items", NUM_ITEMS + int(rng.integers(0, 3)))
    elif kind == "action negative":
        put("actions", -1)
    elif kind == "action too large":
        put("actions", int(rng.integers(4, 9)))
    elif kind == "action beyond 1024":
        put("actions", 1024 + int(rng.integers(0, 3)))
    elif kind == "negative timestamp":
        put("timestamps", -7)
    elif kind == "unsorted timestamps":
        row["timestamps"] = list(reversed(row["timestamps"]))
    elif kind == "null list":
        row[str(rng.choice(["items", "actions", "timestamps", "shop"]))] = None
    elif kind == "null value":
        put(str(rng.choice(["items", "actions", "timestamps", "shop"])), None)
    elif kind == "shop too large":
        put("shop", SHOP_ROWS + int(rng.integers(0, 3)))
    elif kind == "shop negative":
        put("shop", -2)
    elif kind == "empty row":
        for c in row:
            row[c] = []


def _write(path, rng, rows, row_group):
    """``rows`` as one Parquet file, with an empty row group now and then."""
    columns = ["items", "actions", "timestamps", "shop"]
    types = {c: pa.list_(pa.int64()) for c in columns}
    if rng.random() < 0.3:
        types["items"] = pa.list_(pa.int32())
    if rng.random() < 0.3:
        types["actions"] = pa.large_list(pa.int16())
    schema = pa.schema([(c, types[c]) for c in columns])
    metadata = {"freescale.num_items": str(NUM_ITEMS)}
    actions = rng.choice(["", "4", "2000"])  # "": 1024 (MAX_ACTIONS); 2000: above it
    if actions:
        metadata["freescale.num_actions"] = str(actions)
    schema = schema.with_metadata(metadata)
    with pq.ParquetWriter(path, schema) as writer:
        for lo in range(0, len(rows), row_group):
            if rng.random() < 0.15:
                writer.write_table(pa.Table.from_pylist([], schema=schema))
            part = rows[lo : lo + row_group]
            writer.write_table(pa.Table.from_pylist(part, schema=schema))
    return metadata


def _reference(source):
    """The first problem of the per-row reading code, pieces in order."""
    for piece in range(source.files.piece_rows.size):
        try:
            source._reference_histories(piece, source._read(piece, source.files.columns))
        except DataFormatError as e:
            return str(e)
    return None


def _outcome(read, piece):
    try:
        return [(r, h.items, h.actions, h.timestamps, h.features) for r, h in read(piece)]
    except DataFormatError as e:
        return str(e)


def test_the_sliced_histories_equal_the_per_row_reference(tmp_path):
    """The stream's fast read (numpy slices of whole columns) gives the per-row
    code's histories, dtype and order included (unsorted timestamps, empty rows,
    int16/int32 columns, features, no optional column), or its error."""
    rng = np.random.default_rng(7)
    outcomes = set()
    for case in range(60):
        rows = _rows(rng, int(rng.integers(1, 40)))
        for _ in range(int(rng.integers(0, 3))):
            kind = "unsorted timestamps" if rng.random() < 0.5 else str(rng.choice(KINDS))
            _corrupt(rng, rows[int(rng.integers(0, len(rows)))], kind)
        if rng.random() < 0.2:  # items only: no actions, timestamps or features
            rows = [{"items": r["items"]} for r in rows if r["items"] is not None]
        directory = tmp_path / f"c{case}"
        directory.mkdir()
        if rows and len(rows[0]) == 1:
            pq.write_table(pa.Table.from_pylist(rows), directory / "a.parquet", row_group_size=4)
            source = _source(directory)
        else:
            _write(directory / "a.parquet", rng, rows, int(rng.integers(1, 9)))
            source = _source(directory, features=f"shop:uih:{SHOP_ROWS}")
        for piece in range(source.files.piece_rows.size):
            table = source._read(piece, source.files.columns)
            fast = _outcome(source._histories, piece)
            ref = _outcome(partial(source._reference_histories, table=table), piece)
            if isinstance(ref, str):
                assert fast == ref
                outcomes.add("error")
                continue
            assert len(fast) == len(ref)
            for a, b in zip(fast, ref, strict=True):
                assert a[0] == b[0]
                for x, y in zip(a[1:4], b[1:4], strict=True):
                    assert x.dtype == y.dtype == np.int64 and np.array_equal(x, y)
                assert a[4].keys() == b[4].keys()
                assert all(np.array_equal(a[4][k], b[4][k]) for k in a[4])
            outcomes.add("rows")
    assert outcomes == {"rows", "error"}


def test_the_vectorized_check_finds_the_per_row_codes_first_problem(tmp_path):
    rng = np.random.default_rng(2024)
    seen_kinds, clean, checked = set(), 0, 0
    for case in range(100):
        rows = _rows(rng, int(rng.integers(1, 40)))
        for _ in range(int(rng.integers(0, 4))):
            kind = str(rng.choice(KINDS))
            _corrupt(rng, rows[int(rng.integers(0, len(rows)))], kind)
            seen_kinds.add(kind)
        directory = tmp_path / f"c{case}"
        directory.mkdir()
        metadata = _write(directory / "a.parquet", rng, rows, int(rng.integers(1, 9)))
        source = _source(directory, features=f"shop:uih:{SHOP_ROWS}")
        want = _reference(source)
        assert first_problem(source) == want, (case, metadata)
        assert first_problem(source, round_rows=1) == want  # one agreement per stride
        for world in (2, 3):  # each rank's share; the smallest piece wins
            found = [f for r in range(world) for f in check_rounds(source, r, world, 5) if f]
            got = min(found)[1] if found else None
            assert got == want, (case, world)
        clean += want is None
        checked += 1
    assert seen_kinds == set(KINDS) and 10 < clean < checked - 40  # both outcomes, often


def test_columns_in_the_order_the_rows_are_checked(tmp_path):
    """A row with several problems: the per-row code's first one is named."""
    table = pa.table(
        {
            "items": [[1, 2], [1, -2, 80], [3]],
            "actions": [[0, 0], [5000, 1, 2], [0]],
            "shop": [[0, 0], [9, None, 1], [0]],
        }
    ).replace_schema_metadata({"freescale.num_items": str(NUM_ITEMS)})
    pq.write_table(table, tmp_path / "a.parquet")
    source = _source(tmp_path, features="shop:uih:6")
    line = first_problem(source)
    assert line == _reference(source)
    assert line.endswith("a.parquet: row group 0, row 1: shop value None is not an integer")


def test_a_row_group_read_in_several_chunks_names_its_row(tmp_path):
    pq.write_table(pa.table({"items": [[1, 2, 3]]}), tmp_path / "a.parquet")
    rules = RowRules.of(_source(tmp_path))
    good = pa.table({"items": [[1, 2, 3]] * 5})
    bad = pa.table({"items": [[1, 2], [3, -1]]})
    table = pa.concat_tables([good, good.slice(1, 2), bad])  # 3 chunks, one sliced
    assert len(table.to_batches()) == 3
    line = piece_problem(table, "f.parquet", 4, 100, rules)
    assert line == "f.parquet: row group 4, row 108: negative item -1"


def test_too_many_targets_in_a_row_is_named_before_the_stream_reaches_it(tmp_path):
    table = pa.table({"items": [[1, 2, 3, 4], list(range(2**16 + 4))]})
    pq.write_table(table, tmp_path / "a.parquet")
    source = open_source(
        f"parquet-stream:{tmp_path}",
        SyntheticConfig(num_items=2**17),
        SequenceSampling(samples_per_user=0),
    )
    line = first_problem(source)
    assert line is not None and "a.parquet: row group 0, row 1: items has 65540 events" in line
    assert "65537 training targets" in line and "data.samples_per_user" in line
    with pytest.raises(DataFormatError) as read:  # data.check=off: the stream's own line
        source.batch(0, 0, 1, 2)
    assert str(read.value) == line
    ok = open_source(f"parquet-stream:{tmp_path}", SyntheticConfig(num_items=2**17))
    assert first_problem(ok) is None  # one target per user by default


def test_rounds_cover_the_pieces_once_in_strides_of_the_world_size(tmp_path):
    pq.write_table(pa.table({"items": [[1, 2, 3]] * 23}), tmp_path / "a.parquet", row_group_size=2)
    files = _source(tmp_path).files  # 12 pieces: 11 of 2 rows, 1 of 1
    assert rounds(files, 5, 7) == [(0, 5), (5, 10), (10, 12)]
    assert rounds(files, 2, 10**6) == [(0, 12)]
    assert rounds(files, 3, 1) == [(0, 3), (3, 6), (6, 9), (9, 12)]
    source = _source(tmp_path)
    for world in (1, 2, 5):  # as many rounds on every rank, even with no piece in the last
        assert {len(list(check_rounds(source, r, world, 7))) for r in range(world)} == {
            len(rounds(files, world, 7))
        }


def test_an_unreadable_file_and_check_off(tmp_path):
    pq.write_table(pa.table({"items": [[1, 2, 3], [-1, 2]]}), tmp_path / "a.parquet")
    assert "row group 0, row 1: negative item -1" in first_problem(_source(tmp_path))
    assert list(_source(tmp_path, check="off").check_rows(0, 1)) == []
    assert list(_source(tmp_path, check=False).check_rows(0, 1)) == []
    with pytest.raises(ValueError, match=r"data\.check must be on or off, got 'maybe'"):
        _source(tmp_path, check="maybe")
    source = _source(tmp_path)
    (tmp_path / "a.parquet").write_bytes(b"gone")  # after the footers were read
    line = first_problem(source)
    assert line.startswith(f"{tmp_path / 'a.parquet'}: row group 0: ") and "\n" not in line


def test_with_the_check_off_the_step_raises_the_same_line(tmp_path):
    """Rank 1 of 2 reads pieces 1, 3, 5 (shuffle off, a window each): the batch of the
    step that reaches the bad row of piece 5 raises the check's line, not before."""
    rows = [[1, 2, 3, 4]] * 12
    rows[10] = [1, 2, 3, 70]
    table = pa.table({"items": rows}).replace_schema_metadata({"freescale.num_items": "50"})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    source = _source(tmp_path, check="off", shuffle_buffer=1)  # one sample per row
    for step in range(2):  # samples 0-3 of rank 1: pieces 1 and 3
        source.batch(step, 1, 2, 2)
    with pytest.raises(DataFormatError) as e:
        source.batch(2, 1, 2, 2)
    assert str(e.value) == first_problem(_source(tmp_path))
    assert "a.parquet: row group 5, row 10: items value 70 is outside 0..49" in str(e.value)


# ---- agreed by the ranks of a run --------------------------------------------------


def _check_rank(path: str, round_rows: int) -> str | None:
    import torch.distributed as dist

    from freescale.pipeline.inputs import check_all_rows

    source = _source(path)
    source.check_rows = lambda rank, world: check_rounds(source, rank, world, round_rows)
    group = dist.new_group(backend="gloo")
    try:
        check_all_rows(source, group, dist.get_rank(), dist.get_world_size())
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("round_rows", [1, 10**6])
def test_every_rank_raises_the_first_problem_in_piece_order(tmp_path, round_rows):
    """Rank 1 owns pieces 1, 3, 5...: a bad row in piece 5 beats rank 0's piece 8."""
    rows = [[1, 2, 3]] * 20
    rows[11] = [1, 99]  # piece 5 (row groups of 2 rows)
    rows[17] = [-4]  # piece 8
    table = pa.table({"items": rows}).replace_schema_metadata({"freescale.num_items": "50"})
    pq.write_table(table, tmp_path / "a.parquet", row_group_size=2)
    out = run_ranks(_check_rank, 2, str(tmp_path), round_rows, timeout=60)
    want = f"{tmp_path / 'a.parquet'}: row group 5, row 11: items value 99 is outside 0..49"
    assert out[0] == out[1] and out[0].startswith(want), out
