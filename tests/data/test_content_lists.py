"""Per-candidate content from a file: a list-of-lists column
(``data.features=NAME:content``; Parquet ``list<list<int>>``, CSV lists joined
by ``;``) is each candidate's content, its item's list, checked row by row
like the other columns; a model reading it trains bit-identically in every
mode and as on the same data built in memory."""

import importlib.util

import numpy as np
import pytest
import torch

from freescale.config import build_config
from freescale.data import DataFormatError
from freescale.data.columnar import read_columns
from freescale.data.readers import SequenceDataset, UserHistory
from freescale.data.sequences import SequenceSource
from freescale.jagged.schema import Feature
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks
from tests.fixtures.own_model.content_model import build

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is None, reason="needs pyarrow (the data extra)"
)
TABLES = ("items", "brands")


def brand_of(item: int) -> list[int]:
    """A fixed content list per raw item id (0 to 3 values below 7)."""
    return [(item * 5 + k) % 7 for k in range(item % 4)]


def histories(users: int = 24) -> list[list[int]]:
    rng = np.random.default_rng(3)
    return [(rng.integers(0, 30, int(rng.integers(4, 9))) * 11 + 5).tolist() for _ in range(users)]


def write_parquet(path, users: list[list[int]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    brands = [[brand_of(i) for i in items] for items in users]
    table = pa.table({"items": users, "brand": brands})
    assert table.schema.field("brand").type == pa.list_(pa.list_(pa.int64()))
    pq.write_table(table, path)


def in_memory(users: list[list[int]]) -> SequenceDataset:
    """The same data built by hand: ids by first appearance, each item's list."""
    raw = list(dict.fromkeys(i for items in users for i in items))
    row = {r: k for k, r in enumerate(raw)}
    lengths = [len(brand_of(r)) for r in raw]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    values = np.array([v for r in raw for v in brand_of(r)], dtype=np.int64)
    history = [
        UserHistory(np.array([row[i] for i in items]), np.zeros(len(items), np.int64),
                    np.arange(len(items)))
        for items in users
    ]  # fmt: skip
    return SequenceDataset(
        history,
        len(raw),
        1,
        "memory",
        features=(Feature("brand", "content", 7),),
        item_content={"brand": (offsets, values)},
        item_ids=np.array(raw),
    )


def test_parquet_and_csv_give_each_candidate_its_items_content(tmp_path):
    users = histories(6)
    write_parquet(tmp_path / "u.parquet", users)
    csv = tmp_path / "u.csv"

    def field(items: list[int]) -> str:
        return ";".join(" ".join(map(str, brand_of(i))) for i in items)

    rows = [f'"{" ".join(map(str, items))}","{field(items)}"' for items in users]
    csv.write_text("items,brand\n" + "\n".join(rows) + "\n")
    for path in (tmp_path / "u.parquet", csv):
        ds = read_columns(path, features="brand:content")
        assert ds.features == (Feature("brand", "content", 7),)
        source = SequenceSource(ds)
        batch = source.batch(0, 0, 1, 6)
        raw = ds.item_ids[batch.candidates["item_ids"].numpy()]
        want = [v for r in raw.tolist() for v in brand_of(r)]
        assert batch.content["brand"].tolist() == want
        assert batch.content.offsets.diff().tolist() == [len(brand_of(r)) for r in raw.tolist()]
        # content_ids: the candidate's own item, once per content item
        assert (
            batch.content["content_ids"].tolist()
            == np.repeat(
                batch.candidates["item_ids"].numpy(), batch.content.offsets.diff().numpy()
            ).tolist()
        )


@pytest.mark.parametrize(
    ("brand", "spec", "why"),
    [
        ('"1 2;3"', "brand:content", "row 2: brand has 2 values, items has 3"),
        ('"1;2;3"', "brand:content", "row 2: brand [3] for item 10, which has brand [1] in row 2"),
        ('"1;2;-1"', "brand:content", "row 2: brand value '-1' is not an integer >= 0"),
        ('"1;2;1 9"', "brand:content:5", "row 2: brand value 9 is outside 0..4"),
    ],
)
def test_a_bad_content_row_is_one_line_naming_file_row_and_column(tmp_path, brand, spec, why):
    csv = tmp_path / "u.csv"
    csv.write_text(f'items,brand\n"10 20 10",{brand}\n')
    with pytest.raises(DataFormatError) as e:
        read_columns(csv, features=spec)
    assert str(e.value).startswith(f"{csv}: {why}")


def test_content_is_named_at_its_level_only(tmp_path):
    with pytest.raises(ValueError, match="at level content holds a list per event"):
        read_columns(tmp_path / "x.csv", features="brand:uih,brand:content")


def _run(overrides: list[str], path: str | None) -> dict:
    cfg = build_config("demo", [*overrides, "output.progress=false", "evaluation.every=0"])
    data = None
    if path is None:
        data = SequenceSource(in_memory(histories()), cfg.data.synthetic_configs(cfg.run.seed)[1])
    trainer = Trainer(cfg, model=build, data=data)
    trainer.run()
    emb = trainer.embeddings
    return {
        "losses": [s["loss"] for s in trainer.summary.steps],
        "tables": {t: emb.full_table(t) for t in TABLES},
        "state": {t: emb.full_optimizer_state(t) for t in TABLES},
        "dense": {k: v.detach().clone() for k, v in trainer.model.named_parameters()},
    }


def _assert_same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for t in TABLES:
        assert torch.equal(a["tables"][t], b["tables"][t]), t
        for k in a["state"][t]:
            assert torch.equal(a["state"][t][k], b["state"][t][k]), (t, k)
    for k in a["dense"]:
        assert torch.equal(a["dense"][k], b["dense"][k]), k


def _file_and_memory(tmp_path, world: int, modes: tuple[str, ...]) -> None:
    path = tmp_path / "u.parquet"
    write_parquet(path, histories())
    common = ["run.steps=4", "run.warmup=1", f"run.nproc={world}", "run.batch_size=4",
              "data.samples_per_user=0", "data.max_uih=6"]  # fmt: skip
    file = [f"data=parquet:{path}", "data.features=brand:content"]
    runs = {
        mode: run_ranks(_run, world, [*common, *file, f"run.mode={mode}"], str(path), timeout=240)
        for mode in modes
    }
    runs["memory"] = run_ranks(_run, world, [*common, "run.mode=sync"], None, timeout=240)
    for other in runs:
        for rank in range(world):
            _assert_same(runs[modes[0]][rank], runs[other][rank])
    assert (runs["memory"][0]["tables"]["brands"] != 0).any()


def test_a_parquet_file_with_content_trains_as_the_same_data_in_memory(tmp_path):
    _file_and_memory(tmp_path, 1, ("freescale",))


@pytest.mark.slow
def test_a_parquet_file_with_content_trains_alike_in_every_mode_and_in_memory(tmp_path):
    _file_and_memory(tmp_path, 2, ("sync", "sdd", "freescale"))
