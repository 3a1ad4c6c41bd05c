"""Export refuses a model whose table is smaller than the ids it would be given.

The user model of tests/pipeline/_two_tables.py with an item table of 100
rows on data of 2000 items: one line naming the table, before tracing,
whether the example batch holds such an id or only the data's largest would.
"""

import pytest
import torch

from freescale.data import SyntheticConfig, SyntheticSource
from freescale.jagged.schema import DataSchema
from freescale.serving import export_model
from freescale.serving.exporter import check_tables
from tests.pipeline._two_tables import build

SCHEMA = DataSchema.standard(2000, 4)
TOO_SMALL = "the model's table is smaller than the ids its embedding_inputs gives it"


def _example(num_items: int):
    return SyntheticSource(SyntheticConfig(num_items=num_items, max_uih=16)).batch(0, 0, 1, 8)


def test_an_id_of_the_example_beyond_its_table_is_one_line(tmp_path):
    example = _example(2000)
    with pytest.raises(ValueError) as e:
        export_model(build(SCHEMA, item_rows=100), example, tmp_path / "out", schema=SCHEMA)
    line = str(e.value)
    assert line.startswith("export: table 'items' (feature 'items') looked up id "), line
    assert f"outside its rows [0, 100) for the example batch: {TOO_SMALL}" in line
    assert "\n" not in line and not (tmp_path / "out").exists()


def test_the_data_s_largest_ids_are_checked_where_the_example_has_none():
    example = _example(100)  # every id below 100: the example alone would pass
    check_tables(build(SCHEMA, item_rows=100), example, None)
    with pytest.raises(ValueError, match=r"id 1999, outside its rows \[0, 100\) for the data's"):
        check_tables(build(SCHEMA, item_rows=100), example, SCHEMA)
    check_tables(build(SCHEMA), example, SCHEMA)  # sized from the schema: nothing to say
    largest = torch.cat([example.uih["item_ids"], example.candidates["item_ids"]])
    assert int(largest.max()) < 100
