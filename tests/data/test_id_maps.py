"""Id maps (`freescale.data.ids`): the readers keep the raw id of every row,
remap through a given map, and a map turns raw ids back into rows."""

import numpy as np
import pytest
import torch

from freescale.data import DataFormatError, read_sasrec
from freescale.data.columnar import read_columns
from freescale.data.ids import RowsOf, read_maps, write_maps


def test_readers_keep_the_raw_id_of_each_row_and_remap_through_a_given_map(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("1 3000006\n1 1000003\n2 3000006\n2 9000027\n")
    first = read_sasrec(path)
    assert first.item_ids.tolist() == [3000006, 1000003, 9000027]
    given = np.array([9000027, 5, 1000003, 3000006])
    again = read_sasrec(path, ids=given)
    assert again.num_items == 4 and again.item_ids.tolist() == given.tolist()
    assert [h.items.tolist() for h in again.users] == [[3, 2], [3, 0]]
    with pytest.raises(DataFormatError, match=r"s.txt:4: item 9000027 is not in the checkpoint"):
        read_sasrec(path, ids=np.array([3000006, 1000003]))
    csv = tmp_path / "u.csv"
    csv.write_text('items\n"3000006 1000003"\n"9000027"\n')
    assert read_columns(csv, ids=given).item_ids.tolist() == given.tolist()
    with pytest.raises(DataFormatError, match=r"u.csv: row 3: item 9000027 is not in"):
        read_columns(csv, ids=given[2:])


def test_a_map_round_trips_and_maps_raw_ids_to_rows(tmp_path):
    raw = np.array([70, 10, 999_999_999_989, 40])
    assert write_maps({"items": raw}, tmp_path) == ["ids/items.npy"]
    assert read_maps(tmp_path)["items"].tolist() == raw.tolist()
    rows = RowsOf(raw, "the export's id map")
    assert rows(torch.tensor([40, 70, 999_999_999_989]), "x").tolist() == [3, 0, 2]
    assert rows(torch.zeros(0, dtype=torch.int64), "x").numel() == 0
    with pytest.raises(ValueError, match=r"^candidates.item_ids: 11 is not in the export's id map"):
        rows(torch.tensor([10, 11]), "candidates.item_ids")
    np.save(tmp_path / "ids" / "bad.npy", np.array([1, 1]))
    with pytest.raises(ValueError, match="not a 1-D array of distinct integer ids"):
        read_maps(tmp_path)
