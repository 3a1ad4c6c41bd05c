"""``freescale data convert events:PATH DST``: one row per event (user_id,
item_id, timestamp[, action], files sorted by user) to the parquet-stream
layout, out of core: the histories equal a direct grouping of the events,
users spanning row groups included; bad input is one line naming the file."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from freescale.data import SequenceSampling, SyntheticConfig, open_source
from freescale.data.convert import convert

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
ROOT = Path(__file__).resolve().parents[2]


def _events(rng, users, first_user=0):
    rows = []
    for u in range(first_user, first_user + users):
        n = int(rng.integers(0, 9))  # zero-event users simply do not appear
        stamps = rng.integers(0, 50, n)  # unsorted within a user, ties included
        for t in stamps:
            rows.append((u, int(rng.integers(0, 40)), int(t), int(rng.integers(0, 3))))
    return rows


def _write(path, rows, row_group, action=True):
    cols = list(zip(*rows, strict=True)) if rows else [[], [], [], []]
    data = {"user_id": cols[0], "item_id": cols[1], "timestamp": cols[2]}
    if action:
        data["action"] = cols[3]
    table = pa.table({k: pa.array(v, pa.int64()) for k, v in data.items()})
    pq.write_table(table, path, row_group_size=row_group)


def _want(rows):
    """Per user in order: (items, actions, timestamps), events sorted by time, stably."""
    out = {}
    for u, item, t, a in rows:
        out.setdefault(u, []).append((t, item, a))
    return {
        u: tuple(np.array([e[k] for e in sorted(ev, key=lambda e: e[0])]) for k in (1, 2, 0))
        for u, ev in out.items()
    }


@pytest.mark.parametrize("flush", [5, 4_000_000])  # whole users written every few events, or once
@pytest.mark.parametrize("row_group", [1, 3, 1000])
def test_events_become_one_row_per_user(tmp_path, row_group, flush, monkeypatch):
    monkeypatch.setattr("freescale.data.events.FLUSH_EVENTS", flush)
    rng = np.random.default_rng(row_group)
    src = tmp_path / "src"
    src.mkdir()
    rows_a, rows_b = _events(rng, 30), _events(rng, 20, first_user=30)
    _write(src / "a.parquet", rows_a, row_group)
    _write(src / "b.parquet", rows_b, row_group)
    summary = convert(f"events:{src}", tmp_path / "dst", row_group=4, say=lambda m: None)
    got = {}
    for part in sorted((tmp_path / "dst").iterdir()):
        table = pq.read_table(part)
        meta = table.schema.metadata
        assert meta[b"freescale.num_items"] == str(summary["items"]).encode()
        for r in table.to_pylist():
            got[r["user_id"]] = (r["items"], r["actions"], r["timestamps"])
    want = _want(rows_a + rows_b)
    assert got.keys() == want.keys() and summary["users"] == len(want)
    for u, (items, actions, stamps) in want.items():
        assert got[u] == (items.tolist(), actions.tolist(), stamps.tolist()), u
    assert summary["events"] == len(rows_a) + len(rows_b)
    items = max(r[1] for r in rows_a + rows_b) + 1
    assert summary["items"] == items and summary["actions"] == 3
    # the stream reads the result
    stream = open_source(
        f"parquet-stream:{tmp_path / 'dst'}", SyntheticConfig(num_items=items),
        SequenceSampling(max_uih=8),
    )  # fmt: skip
    assert stream.batch(0, 0, 1, 4).batch_size == 4


def test_without_an_action_column_actions_are_zero(tmp_path):
    rows = _events(np.random.default_rng(0), 5)
    _write(tmp_path / "e.parquet", rows, 2, action=False)
    summary = convert(f"events:{tmp_path / 'e.parquet'}", tmp_path / "dst", say=lambda m: None)
    table = pq.read_table(tmp_path / "dst" / "part-00000.parquet")
    assert summary["actions"] == 1
    assert all(set(a) <= {0} for a in table.column("actions").to_pylist())


def _cli(*args):
    cmd = [sys.executable, "-m", "freescale.cli.main", "data", "convert", *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_bad_events_are_one_line_rc_2(tmp_path):
    unsorted = [(0, 1, 5, 0), (2, 1, 5, 0), (1, 3, 1, 0)]
    _write(tmp_path / "u.parquet", unsorted, 2)
    done = _cli(f"events:{tmp_path / 'u.parquet'}", tmp_path / "d1")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "u.parquet: row group 1, row 0: user_id 1 after 2" in done.stderr
    pq.write_table(
        pa.table({"user_id": [0], "item_id": [-1], "timestamp": [0]}), tmp_path / "n.parquet"
    )
    done = _cli(f"events:{tmp_path / 'n.parquet'}", tmp_path / "d2")
    assert done.returncode == 2 and "item_id -1 is negative" in done.stderr
    pq.write_table(
        pa.table({"user_id": [0], "item_id": [1.5], "timestamp": [0]}), tmp_path / "f.parquet"
    )
    done = _cli(f"events:{tmp_path / 'f.parquet'}", tmp_path / "d3")
    assert done.returncode == 2 and "column 'item_id' is double, not integers" in done.stderr
    # streaming the event layout directly says what to do
    with pytest.raises(ValueError, match="freescale data convert events:PATH"):
        open_source(f"parquet-stream:{tmp_path / 'u.parquet'}", SyntheticConfig())
