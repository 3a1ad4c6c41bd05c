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
