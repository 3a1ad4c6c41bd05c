"""`starting_at`: a run resumed at another world size continues the sample stream
where it stopped, neither skipping nor repeating a sample."""

import pytest
import torch

from freescale.data import SequenceSampling, SequenceSource, SyntheticConfig, SyntheticSource
from freescale.jagged.batch import UIH_IDS
from tests.data.test_split import LENGTHS, unique_item_dataset

B = 3


def _sources():
    yield SyntheticSource(SyntheticConfig(num_items=500, max_uih=16))
    sampling = SequenceSampling(max_uih=8, samples_per_user=0, shuffle=True)
    yield SequenceSource(unique_item_dataset(LENGTHS), sampling)


def _read(source, steps, world):
    """Sample ids of each step (ranks in order) and the batches."""
    out = []
    for step in steps:
        batches = [source.batch(step, r, world, B) for r in range(world)]
        out.append((torch.cat([b.sample_id for b in batches]), batches))
    return out


@pytest.mark.parametrize("source", list(_sources()), ids=["synthetic", "file"])
def test_a_world_size_change_continues_the_stream(source):
    """2 ranks for steps 0-2, 4 ranks for 3-4, 1 rank for 5-7: one gapless stream,
    and each sample is the one an unresumed reader sees at its position."""
    seen = [ids for ids, _ in _read(source, range(3), 2)]
    four = source.starting_at(3, 3 * 2 * B)
    seen += [ids for ids, _ in _read(four, range(3, 5), 4)]
    one = source.starting_at(5, 3 * 2 * B + 2 * 4 * B)
    read = _read(one, range(5, 8), 1)
    seen += [ids for ids, _ in read]
    assert torch.equal(torch.cat(seen), torch.arange(3 * 2 * B + 2 * 4 * B + 3 * B))
    for _, batches in [*_read(four, range(3, 5), 4), *read]:
        for b in batches:  # each sample is the stream's at its position
            raw = [source.raw_sample(p).uih_ids for p in b.sample_id.tolist()]
            assert b.uih[UIH_IDS].tolist() == [int(x) for r in raw for x in r]


@pytest.mark.parametrize("source", list(_sources()), ids=["synthetic", "file"])
def test_the_same_world_size_reads_the_unresumed_batches(source):
    again = source.starting_at(4, 4 * 2 * B)
    pairs = zip(_read(source, range(4, 6), 2), _read(again, range(4, 6), 2), strict=True)
    for (a, xs), (b, ys) in pairs:
        assert torch.equal(a, b)
        for x, y in zip(xs, ys, strict=True):
            assert torch.equal(x.uih[UIH_IDS], y.uih[UIH_IDS])
            assert torch.equal(x.labels, y.labels)


def test_steps_before_the_origin_are_not_in_the_stream():
    source = SyntheticSource().starting_at(5, 6 * B)
    with pytest.raises(ValueError, match="bad batch request"):
        source.batch(0, 0, 4, B)
    with pytest.raises(ValueError, match="step, position >= 0"):
        source.starting_at(-1, 0)
