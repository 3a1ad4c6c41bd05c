"""Raw item ids (issue 61): a dynamic item table takes the data's own int64 ids.

With ``embeddings.tables.item_emb.capacity`` > 0 the file readers keep each
item's own id (no remap to rows 0..N-1, no id map), the stream takes any
int64 id (no ``num_items`` needed), and negatives are drawn from the ids the
data has: a run on raw ids reads, sample for sample, the batches of the
remapped run with each row replaced by its item's id. ``data.raw_ids=on``
gives synthetic data 64-bit ids (a fixed random injective map of its rows)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from freescale.config import build_config
from freescale.data import DataFormatError
from freescale.data.ids import raw_id_map
from freescale.data.source import id_maps, schema_of
from freescale.data.stream_check import first_problem
from freescale.jagged.batch import CAND_IDS, CONTENT_IDS, UIH_IDS
from freescale.pipeline.setup import make_source

DYNAMIC = "embeddings.tables.item_emb.capacity=40"
needs_pyarrow = pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is None, reason="needs pyarrow (the data extra)"
)


def histories(users: int = 30, items: int = 60, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, items, int(rng.integers(3, 12))).tolist() for _ in range(users)]


def hashed(users: list[list[int]], signed: bool = False) -> list[list[int]]:
    """Each item id sent through the 64-bit map (``signed``: negative ids among
    them; else its low 63 bits, which a remapping reader takes too)."""
    flat = np.array([i for items in users for i in items], dtype=np.int64)
    mapped = raw_id_map(flat, seed=5)
    mapped = iter((mapped if signed else mapped & (2**63 - 1)).tolist())
    return [[next(mapped) for _ in items] for items in users]


def write_sasrec(path, users: list[list[int]]) -> str:
    path.write_text("".join(f"{u} {i}\n" for u, items in enumerate(users) for i in items))
    return f"sasrec:{path}"


def source(spec: str, *settings: str):
    sets = [f"data={spec}", "data.samples_per_user=0", "data.train_negatives=6",
            "data.eval_negatives=9", *settings]  # fmt: skip
    return make_source(build_config("demo", sets))


def ids_of(batch) -> list[torch.Tensor]:
    return [batch.uih[UIH_IDS], batch.candidates[CAND_IDS], batch.content[CONTENT_IDS]]


def assert_mapped(rows_batch, raw_batch, raw_of_row: np.ndarray) -> None:
    """``raw_batch`` is ``rows_batch`` with every item row replaced by its raw id."""
    table = torch.from_numpy(raw_of_row)
    for rows, raw in zip(ids_of(rows_batch), ids_of(raw_batch), strict=True):
        assert torch.equal(table[rows], raw)
    assert torch.equal(rows_batch.labels, raw_batch.labels)
    assert torch.equal(rows_batch.sample_id, raw_batch.sample_id)
    for level in ("uih", "candidates", "content"):
        assert torch.equal(getattr(rows_batch, level).offsets, getattr(raw_batch, level).offsets)


def test_a_dynamic_item_table_reads_the_files_own_ids_sample_for_sample(tmp_path):
    users = hashed(histories())
    spec = write_sasrec(tmp_path / "s.txt", users)
    rows, raw = source(spec), source(spec, DYNAMIC)
    raw_of_row = id_maps(rows)["items"]
    assert id_maps(raw) == {}  # nothing was remapped: no map to keep
    assert raw.num_items == rows.num_items == len(set(i for u in users for i in u))
    for step in range(4):
        assert_mapped(rows.batch(step, 0, 1, 7), raw.batch(step, 0, 1, 7), raw_of_row)
    for split in ("valid", "test"):
        for k in range(2):
            assert_mapped(
                rows.eval_batch(split, k, 0, 1, 8), raw.eval_batch(split, k, 0, 1, 8), raw_of_row
            )
    seen = {i for u in users for i in u}
    assert set(raw.batch(0, 0, 1, 30).candidates[CAND_IDS].tolist()) <= seen
    assert max(seen) > 2**40


def test_the_schema_says_the_item_ids_are_raw(tmp_path):
    spec = write_sasrec(tmp_path / "s.txt", hashed(histories()))
    rows, raw = schema_of(source(spec)), schema_of(source(spec, DYNAMIC))
    items = ("uih.item_ids", "candidates.item_ids", "content.content_ids")
    assert {f.key: f.raw for f in raw.features if f.key in items} == dict.fromkeys(items, True)
    assert not any(f.raw for f in rows.features)
    assert raw.num_items == rows.num_items  # tables that need a size: the catalogue's


def test_popularity_baseline_is_the_same_on_raw_ids(tmp_path):
    from freescale.pipeline.evaluation import popularity_baseline

    spec = write_sasrec(tmp_path / "s.txt", hashed(histories(users=40)))
    rows, raw = source(spec), source(spec, DYNAMIC)
    for split in ("valid", "test"):
        assert popularity_baseline(raw, split, 16) == popularity_baseline(rows, split, 16)


def test_raw_ids_on_keeps_them_without_a_dynamic_table_and_off_remaps(tmp_path):
    users = hashed(histories())
    spec = write_sasrec(tmp_path / "s.txt", users)
    kept = source(spec, "data.raw_ids=on")
    assert set(kept.batch(0, 0, 1, 20).uih[UIH_IDS].tolist()) <= {i for u in users for i in u}
    remapped = source(spec, DYNAMIC, "data.raw_ids=off")
    assert int(remapped.batch(0, 0, 1, 20).uih[UIH_IDS].max()) < remapped.num_items
    assert id_maps(remapped)["items"].size == remapped.num_items


def test_text_ids_may_be_any_int64_but_no_more(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text(f"1 {-(2**63)}\n1 {2**63 - 1}\n1 7\n1 8\n")
    got = source(f"sasrec:{path}", DYNAMIC).dataset.users[0].items.tolist()
    assert got == [-(2**63), 2**63 - 1, 7, 8]
    path.write_text(f"1 5\n1 {2**63}\n")
    with pytest.raises(DataFormatError, match=r"s\.txt:2: item 9223372036854775808 .*int64"):
        source(f"sasrec:{path}", DYNAMIC)
    path.write_text("1 5\n1 -3\n")  # static tables: rows, so no sign (as before)
    with pytest.raises(DataFormatError, match=r"s\.txt:2: item '-3' is not a non-negative"):
        source(f"sasrec:{path}")


@needs_pyarrow
def test_parquet_features_and_content_follow_the_raw_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    small = histories(users=24, items=30)
    users = hashed(small)
    cat = [[i % 5 for i in items] for items in small]  # one value per item
    brand = [[[(i * 3 + k) % 7 for k in range(i % 3)] for i in items] for items in small]
    path = tmp_path / "u.parquet"
    pq.write_table(pa.table({"items": users, "cat": cat, "brand": brand}), path)
    features = "data.features=cat:uih,cat:candidates,brand:content"
    rows, raw = source(f"parquet:{path}", features), source(f"parquet:{path}", features, DYNAMIC)
    raw_of_row = id_maps(rows)["items"]
    for step in range(3):
        a, b = rows.batch(step, 0, 1, 6), raw.batch(step, 0, 1, 6)
        assert_mapped(a, b, raw_of_row)
        assert torch.equal(a.candidates["cat"], b.candidates["cat"])
        assert torch.equal(a.content["brand"], b.content["brand"])
        assert a.content["brand"].numel()  # some candidate has content


@needs_pyarrow
def test_the_stream_takes_any_int64_id_with_a_dynamic_table(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    users = hashed(histories(users=40), signed=True)
    assert min(i for u in users for i in u) < 0
    path = tmp_path / "logs"
    path.mkdir()
    pq.write_table(pa.table({"items": users}), path / "part-0.parquet", row_group_size=8)
    spec = f"parquet-stream:{path}"
    static = r"negative item -\d+|items value \d+ is outside 0\.\.1999"
    with pytest.raises(ValueError, match=static):
        source(spec, "data.check=off").batch(0, 0, 1, 40)  # a static table: rows below num_items
    a, b = source(spec, DYNAMIC), source(spec, DYNAMIC)
    assert first_problem(a) is None  # the check before step 0 takes them too
    assert "negative item" in first_problem(source(spec))
    seen = {i for u in users for i in u}
    assert a.num_items == len(seen)
    for step in range(3):
        x, y = a.batch(step, 0, 2, 9), b.batch(step, 0, 2, 9)
        assert all(torch.equal(p, q) for p, q in zip(ids_of(x), ids_of(y), strict=True))
        assert set(x.candidates[CAND_IDS].tolist()) <= seen  # negatives: ids the data has
        assert set(x.uih[UIH_IDS].tolist()) <= seen
    assert any(f.raw for f in schema_of(a).features)


def test_synthetic_raw_ids_are_a_fixed_injective_map_of_its_rows():
    common = ["data.num_items=500", "run.seed=3"]
    rows = make_source(build_config("demo", common))
    raw = make_source(build_config("demo", [*common, "data.raw_ids=on"]))
    again = make_source(build_config("demo", [*common, "data.raw_ids=on"]))
    pairs: dict[int, int] = {}
    for step in range(3):
        a, b = rows.batch(step, 1, 2, 8), raw.batch(step, 1, 2, 8)
        same = zip(ids_of(b), ids_of(again.batch(step, 1, 2, 8)), strict=True)
        assert all(torch.equal(p, q) for p, q in same)
        assert torch.equal(a.labels, b.labels)
        for r, w in zip(torch.cat(ids_of(a)).tolist(), torch.cat(ids_of(b)).tolist(), strict=True):
            assert pairs.setdefault(r, w) == w  # a function of the row ...
    assert len(set(pairs.values())) == len(pairs) > 100  # ... and injective
    assert max(abs(w) for w in pairs.values()) > 2**40
    assert schema_of(raw).num_items == 500 and any(f.raw for f in schema_of(raw).features)


def test_raw_id_map_is_injective_and_seeded():
    x = np.arange(100_000, dtype=np.int64)
    a = raw_id_map(x, seed=1)
    assert np.unique(a).size == x.size and a.dtype == np.int64
    assert np.array_equal(a, raw_id_map(x, seed=1)) and not np.array_equal(a, raw_id_map(x, 2))


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (["data.raw_ids=maybe"], r"data\.raw_ids must be one of auto, on, off"),
        (["data.raw_ids=on", "data.ids=/tmp/x"], r"data\.ids .* data\.raw_ids"),
        ([DYNAMIC, "data.ids=/tmp/x"], r"data\.ids .*item_emb.*data\.raw_ids=off"),
        (["data=tests.fixtures:nothing", "data.raw_ids=on"], r"data\.raw_ids .*built-in"),
    ],
)
def test_bad_raw_id_settings_are_one_line(settings, match, tmp_path):
    spec = write_sasrec(tmp_path / "s.txt", histories())
    with pytest.raises(ValueError, match=match) as e:
        build_config("demo", [f"data={spec}", *settings])
    assert "\n" not in str(e.value)


def test_another_file_of_raw_ids_has_the_runs_schema(tmp_path):
    """Raw ids need no id map, so a checkpoint evaluates a file with other items
    (`freescale eval --data`): the item count is no part of a raw schema."""
    from freescale.serving.checkpoint import check_schema

    one = write_sasrec(tmp_path / "one.txt", hashed(histories(seed=0)))
    two = write_sasrec(tmp_path / "two.txt", hashed(histories(users=50, items=90, seed=1)))
    a, b = schema_of(source(one, DYNAMIC)), schema_of(source(two, DYNAMIC))
    assert a.num_items != b.num_items
    check_schema(a, b, two, "eval")
    with pytest.raises(ValueError, match=r"eval: .*two\.txt is not the run's data: uih\.item_ids"):
        check_schema(schema_of(source(one)), schema_of(source(two)), two, "eval")
    with pytest.raises(ValueError, match=r"eval: .*is not the run's data: uih\.item_ids"):
        check_schema(schema_of(source(one)), a, one, "eval")  # rows vs raw ids


@needs_pyarrow
def test_an_unsigned_id_past_int64_is_one_line_in_the_stream(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    items = pa.array([[1, 2, 3], [4, 2**63 + 5, 6]], type=pa.list_(pa.uint64()))
    pq.write_table(pa.table({"items": items}), tmp_path / "u.parquet")
    raw = source(f"parquet-stream:{tmp_path / 'u.parquet'}", DYNAMIC)
    assert first_problem(raw).endswith(
        "row group 0, row 1: item 9223372036854775813 does not fit in int64"
    )
