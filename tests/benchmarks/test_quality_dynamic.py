"""benchmarks/quality_dynamic.py: the hashed copy is the file with its item ids
mapped one to one, both runs are valid configurations of the recipe, and the
dynamic table's counts are read from a step log."""

import json

import pytest

from benchmarks.quality_dynamic import dynamic_counts, hashed_copy
from benchmarks.scenario import load, setting
from freescale.config import build_config


def test_the_hashed_copy_maps_each_item_to_one_64_bit_id(tmp_path):
    src, dst = tmp_path / "b.txt", tmp_path / "b64.txt"
    src.write_text("1 10\n1 11\n2 10\n\n2 12\n3 11\n")
    assert hashed_copy(src, dst, seed=0) == 3
    pairs = [line.split() for line in dst.read_text().splitlines()]
    assert [u for u, _ in pairs] == ["1", "1", "2", "2", "3"]
    got = [int(i) for _, i in pairs]
    assert got[0] == got[2] and got[1] == got[4] and len(set(got)) == 3
    assert max(abs(i) for i in got) > 2**40


@pytest.mark.parametrize("smoke", [False, True])
def test_both_runs_are_valid_configs_of_the_recipe(smoke, monkeypatch):
    monkeypatch.setenv("FREESCALE_BEAUTY", "/data/beauty.txt")
    s = load("quality-dynamic")
    s = s.smoked() if smoke else s
    sets = [setting(k, v) for k, v in s.set.items()]
    static = build_config(s.params["preset"], sets)
    for variant in s.params["dynamic"]:
        table = [setting("item_capacity", 6050), setting("item_evict", variant.get("evict", "lru"))]
        dynamic = build_config(s.params["preset"], [*sets, *table, setting("item_admit_after", 2)])
        spec = dynamic.embeddings.dynamics()["item_emb"]
        assert dynamic.raw_item_ids() and spec.capacity == 6050 and spec.admit_after == 2
        assert spec.evict == variant.get("evict", "lru")
    assert static.data.source == "sasrec:/data/beauty.txt" and not static.raw_item_ids()
    assert static.run.batch_size == dynamic.run.batch_size


def test_dynamic_counts_sum_the_step_log(tmp_path):
    steps = [
        {"step": 0, "dynamic_inserts": 5, "dynamic_evictions": 0, "dynamic_not_admitted": 0,
         "dynamic_occupancy_pct": 50.0},
        {"step": 1, "dynamic_inserts": 3, "dynamic_evictions": 2, "dynamic_not_admitted": 1,
         "dynamic_occupancy_pct": 80.0},
    ]  # fmt: skip
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in steps))
    assert dynamic_counts(path) == {
        "inserts": 8, "evictions": 2, "not_admitted": 1, "occupancy_pct": 80.0
    }  # fmt: skip
