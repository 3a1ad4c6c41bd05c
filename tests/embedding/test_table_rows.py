"""`TableRows`: the host check a caller with ``inputs_checked`` owes its lookups.

Two tables of one store lie end to end: the collection trusts a checked id,
so an item id past its table reads the next table's row. The check names
the table and feature instead.
"""

import pytest
import torch

from freescale.comm import FakeWorld
from freescale.embedding import ShardedEmbeddingCollection, TableConfig
from freescale.embedding.table_rows import TableRows
from freescale.jagged import JaggedTensor


def _collection() -> ShardedEmbeddingCollection:
    tables = [TableConfig("items", 100, 4), TableConfig("content", 2000, 4)]
    coll = ShardedEmbeddingCollection(tables, FakeWorld(1).communicator(0), inputs_checked=True)
    coll.set_table("items", torch.zeros(100, 4))
    coll.set_table("content", torch.arange(2000.0).unsqueeze(1).expand(2000, 4).contiguous())
    return coll


def test_an_unchecked_id_past_its_table_reads_the_next_one():
    """Why the check exists: one store, items at slots 0-99, content from 100."""
    coll = _collection()
    assert len(coll.stores) == 1
    bad = r"table 'items' .*id 150, outside \[0, 100\)"
    with torch.no_grad(), coll.prefetch_disabled(), pytest.raises(ValueError, match=bad):
        coll({"items": torch.tensor([150])})  # evaluation: checked on the device
    out = coll({"items": torch.tensor([150])})["items"]  # a training lookup, vouched for
    assert out[0].tolist() == [50.0] * 4  # content's row 50


@pytest.mark.parametrize(
    "features,found",
    [
        ({"items": torch.tensor([3, 99]), "content": torch.tensor([1999])}, None),
        ({"items": torch.tensor([[3], [150]]), "content": torch.tensor([7])}, (1, 150)),
        ({"items": JaggedTensor(torch.tensor([3, -2]), torch.tensor([0, 2]))}, (1, -2)),
        ({"content": torch.tensor([2000]), "items": torch.tensor([100])}, (0, 2000)),
        ({"items": torch.tensor([], dtype=torch.int64), "other": torch.tensor([10**6])}, None),
    ],
)
def test_first_id_beyond_the_rows_of_its_own_table(features, found):
    rows = TableRows.of(_collection().tables.values())
    assert rows.features == (("content", "content", 2000), ("items", "items", 100))
    assert rows.first_beyond(features) == found


def test_the_line_names_table_feature_id_and_rows():
    tables = [TableConfig("ec.t", 100, 4, feature_names=("ec.uih", "ec.cand"))]
    rows = TableRows.of(tables)
    bad = rows.first_beyond({"ec.uih": torch.tensor([1]), "ec.cand": torch.tensor([5, 100])})
    assert bad == (0, 100)
    assert rows.describe(*bad) == (
        "table 'ec.t' (feature 'ec.cand') looked up id 100, outside its rows [0, 100)"
    )
