import json

import numpy as np

from freescale.data import LengthDistribution, SyntheticConfig, SyntheticSource
from freescale.data.stats import RowSet, batch_sparsity, collect_stats, shard_collisions


def test_sparsity_matches_equation_one():
    assert batch_sparsity(np.array([4, 2, 2, 0])) == 1 - 8 / 16
    assert batch_sparsity(np.array([3, 3])) == 0.0
    assert batch_sparsity(np.array([], dtype=np.int64)) == 0.0
    assert batch_sparsity(np.array([0, 0])) == 0.0


def test_shard_collisions_count_unique_rows_per_block():
    prev = RowSet(np.array([0, 1, 1, 5, 9]), num_rows=10)
    nxt = RowSet(np.array([1, 2, 9, 9, 6]), num_rows=10)
    hit, total = shard_collisions(prev, nxt, num_shards=2)  # blocks [0,5), [5,10)
    assert hit.tolist() == [1, 1] and total.tolist() == [2, 2]


def test_collect_stats_sparsity_rises_with_max_uih():
    src = SyntheticSource(
        SyntheticConfig(
            num_items=20_000, lengths=LengthDistribution(median=300, sigma=0.6, cap=1200)
        )
    )
    rows = collect_stats(
        src,
        [50, 200, 800, 1600],
        [16],
        world_size=2,
        steps=3,
        num_shards=2,
        progress=lambda _: None,
    )
    sparsity = [r.sparsity for r in rows]
    assert sparsity == sorted(sparsity) and sparsity[0] < 0.05 < sparsity[-1]
    assert all(0 < r.collision_pct < 100 for r in rows)
    assert rows[-1].max_len <= 1200


def _stats_json(capsys, *args):
    from freescale.cli.main import main

    assert main(["data", "stats", *args]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_file_stats_read_everything_and_rows_do_not_depend_on_other_batch_sizes(capsys, tmp_path):
    rng = np.random.default_rng(0)
    lines = []
    for user in range(1, 200):
        n = int(rng.integers(1, 40))  # some users too short for any sample
        lines += [f"{user} {int(i)}\n" for i in rng.integers(1, 500, n)]
    path = tmp_path / "s.txt"
    path.write_text("".join(lines))
    common = ["--source", f"sasrec:{path}", "--world-size", "2", "--max-uih", "5,50"]
    both = _stats_json(capsys, *common, "--batch-size", "4,16")
    alone = _stats_json(capsys, *common, "--batch-size", "4")
    assert [r for r in both["rows"] if r["batch_size"] == 4] == alone["rows"]
    short = sum(1 for u in range(1, 200) if sum(x.startswith(f"{u} ") for x in lines) < 3)
    assert both["split"]["users_dropped"] == short > 0
    samples = both["split"]["train_samples"]
    assert both["coverage"]["4"]["samples_read"] == samples // 8 * 8
    assert both["coverage"]["16"]["fraction_read"] == samples // 32 * 32 / samples
