import statistics

import numpy as np
import pytest
import torch

from freescale.data import LengthDistribution, SyntheticConfig, SyntheticSource
from freescale.data.distributions import IdScramble, zipf_ranks
from freescale.data.stats import batch_sparsity
from freescale.jagged import SampleBatch
from freescale.jagged.batch import CAND_IDS, CONTENT_IDS, UIH_IDS

SMALL = SyntheticConfig(
    num_items=5000,
    max_uih=300,
    lengths=LengthDistribution(median=120),
    max_candidates=4,
    max_content=3,
    dense_dim=2,
    seed=7,
)


def test_same_seed_same_batches_across_runs():
    a = SyntheticSource(SMALL).batch(step=3, rank=1, world_size=4, batch_size=6)
    b = SyntheticSource(SMALL).batch(step=3, rank=1, world_size=4, batch_size=6)
    a.validate()
    assert a.equal(b)
    c = SyntheticSource(SyntheticConfig(**{**SMALL.__dict__, "seed": 8})).batch(3, 1, 4, 6)
    assert not a.equal(c)


def test_ranks_and_steps_get_distinct_samples():
    src = SyntheticSource(SMALL)
    ids = [src.batch(s, r, 3, 5).sample_id for s in range(2) for r in range(3)]
    assert torch.equal(torch.cat(ids), torch.arange(30))
    assert not src.batch(0, 0, 3, 5).uih.equal(src.batch(0, 1, 3, 5).uih)


def test_global_batch_is_independent_of_world_size():
    src = SyntheticSource(SMALL)
    one_rank = src.batch(step=2, rank=0, world_size=1, batch_size=8)
    # step 2 of W=1, B=8 is samples 16..23: step 2 of W=2, B=4 (rank 0: 16..19, rank 1: 20..23)
    two_ranks = SampleBatch.concat([src.batch(2, r, 2, 4) for r in range(2)])
    assert one_rank.equal(two_ranks)


def test_ids_and_lengths_respect_the_config():
    b = SyntheticSource(SMALL).batch(0, 0, 1, 64)
    for t in (b.uih["item_ids"], b.candidates["item_ids"], b.content["content_ids"]):
        assert int(t.min()) >= 0 and int(t.max()) < SMALL.num_items
    assert int(b.uih_lengths().max()) <= SMALL.max_uih
    n = b.num_candidates()
    assert int(n.min()) >= 1 and int(n.max()) <= SMALL.max_candidates
    assert int(b.candidate_lengths().max()) <= SMALL.max_content
    assert b.dense is not None and b.dense.shape == (64, 2)
    assert set(b.labels.unique().tolist()) <= {0.0, 1.0}


def test_truncation_keeps_the_most_recent_items():
    src = SyntheticSource(SMALL)
    full, short = src.raw_sample(11, max_uih=300), src.raw_sample(11, max_uih=10)
    assert np.array_equal(short.uih_ids, full.uih_ids[-10:])
    assert np.array_equal(short.cand_ids, full.cand_ids)


def test_zero_length_uih_is_possible():
    cfg = SyntheticConfig(
        num_items=100, lengths=LengthDistribution(kind="fixed", median=1, low=0, cap=0)
    )
    b = SyntheticSource(cfg).batch(0, 0, 1, 3)
    assert b.uih_lengths().tolist() == [0, 0, 0]
    assert batch_sparsity(b.uih_lengths().numpy()) == 0.0


def test_labels_carry_signal_from_the_hidden_model():
    """The ground truth must be learnable: its own probabilities beat the base
    rate by a clear margin (normalized entropy well under 1)."""
    src = SyntheticSource(
        SyntheticConfig(num_items=2000, max_uih=50, lengths=LengthDistribution(median=30))
    )
    p_all, y_all = [], []
    for g in range(400):
        s = src.raw_sample(g)
        p_all.append(src.truth.probability(s.uih_ids, s.cand_ids))
        y_all.append(s.labels)
    p, y = np.concatenate(p_all), np.concatenate(y_all)
    base = y.mean()
    ce = -np.mean(y * np.log(p) + (1 - y) * np.log(1 - p))
    h = -(base * np.log(base) + (1 - base) * np.log(1 - base))
    assert 0.15 < base < 0.6
    assert ce / h < 0.85


def test_zipf_is_skewed_and_in_range():
    rng = np.random.default_rng(0)
    r = zipf_ranks(rng, 100_000, 1000, 1.05)
    assert r.min() >= 0 and r.max() < 1000
    counts = np.bincount(r, minlength=1000)
    assert counts[0] > 10 * counts[500:].mean()


def test_scramble_is_a_bijection():
    for n in (1, 7, 1000, 4096):
        s = IdScramble.make(n, seed=3)
        assert sorted(s(np.arange(n)).tolist()) == list(range(n))


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_items=0),
        dict(max_uih=-1),
        dict(zipf_alpha=0.0),
        dict(max_candidates=0),
    ],
)
def test_bad_config_raises(bad):
    with pytest.raises(ValueError):
        SyntheticConfig(**bad)


def test_bad_length_distribution_raises():
    with pytest.raises(ValueError, match="length kind"):
        LengthDistribution(kind="gaussian")


def test_bad_batch_request_raises():
    with pytest.raises(ValueError, match="bad batch request"):
        SyntheticSource(SMALL).batch(0, 3, 2, 4)


def _collision(source: SyntheticSource, step: int) -> float:
    """Share of step ``step``'s unique rows that step ``step + 1`` reads again."""

    def rows(s: int) -> set[int]:
        b = source.batch(s, 0, 1, 16)
        return set(torch.cat([b.uih[UIH_IDS], b.candidates[CAND_IDS],
                              b.content[CONTENT_IDS]]).tolist())  # fmt: skip

    now, nxt = rows(step), rows(step + 1)
    return len(now & nxt) / len(now)


def test_step_overlap_controls_consecutive_step_collisions():
    def cfg(overlap: float) -> SyntheticConfig:
        return SyntheticConfig(num_items=5_000, zipf_alpha=1.1, max_uih=64,
                               lengths=LengthDistribution(median=40, sigma=0.5, cap=64),
                               step_overlap=overlap)  # fmt: skip

    rates = [statistics.mean(_collision(SyntheticSource(cfg(o)), s) for s in range(3))
             for o in (1.0, 0.5, 0.0)]  # fmt: skip
    assert rates[0] > rates[1] > rates[2], rates
    assert rates[2] < 0.2 * rates[0], rates
    # Only ids move: lengths, labels and sample ids are those of the plain stream.
    plain = SyntheticSource(cfg(1.0)).batch(3, 1, 2, 4)
    moved = SyntheticSource(cfg(0.5)).batch(3, 1, 2, 4)
    assert torch.equal(plain.uih.offsets, moved.uih.offsets)
    assert torch.equal(plain.labels, moved.labels)
    assert torch.equal(plain.content.offsets, moved.content.offsets)
    assert not torch.equal(plain.uih[UIH_IDS], moved.uih[UIH_IDS])
