"""``parquet-stream`` resumed at another world size: the rest of the epochs is
redealt to the new ranks, and over the whole run (every segment, every rank)
the samples read with an epoch's tag hold no repeat; an epoch every rank has
passed holds exactly the epoch's samples. Checked by sample id."""

from collections import Counter

import pytest

from freescale.data.stream_resume import check_segments
from freescale.state.position import DataPosition, add_segment, resume_record, resumed_source
from tests.data.test_parquet_stream import _all_samples, _source, write_logs

pytest.importorskip("pyarrow")


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """3 files of 30 users, row groups of 4 rows (24 pieces, ~100 samples an epoch)."""
    path = tmp_path_factory.mktemp("logs")
    return path, _all_samples(write_logs(path))


def _segments(*resumes: tuple[int, int], world: int) -> tuple:
    """The segments a run gets from the trainer: started at ``world`` ranks,
    resumed at (step, world size) after (step, world size)."""
    segments = ((0, world),)
    for step, new in resumes:
        segments = add_segment(segments, step, new)
    return segments


def _read(source, steps: int, batch: int) -> tuple[dict[int, Counter], int]:
    """({epoch: sample ids read with its tag}, the first epoch some rank of the
    last segment has not finished) over global steps ``0..steps-1``. A rank's
    epochs never decrease within a segment."""
    segments = source.segments
    tagged: dict[int, Counter] = {}
    for step in range(steps):
        first, world = [s for s in segments if s[0] <= step][-1]
        for rank in range(world):
            ids = source.batch(step, rank, world, batch).sample_id.tolist()
            epochs = source.batch_epochs(step, rank, world, batch)
            before = source.batch_epochs(step - 1, rank, world, batch)[-1] if step > first else 0
            assert sorted(epochs) == epochs and before <= epochs[0], (step, rank)
            for epoch, sid in zip(epochs, ids, strict=True):
                tagged.setdefault(epoch, Counter())[sid] += 1
    world = segments[-1][1]
    unfinished = min(source.batch_epochs(steps, r, world, batch)[0] for r in range(world))
    return tagged, unfinished


def _check(source, steps: int, batch: int, all_ids: set) -> dict[int, Counter]:
    tagged, unfinished = _read(source, steps, batch)
    assert unfinished >= 1  # the runs below pass at least one epoch end
    for epoch in range(max(tagged) + 1):
        ids = tagged.get(epoch, Counter())
        assert max(ids.values(), default=1) == 1, f"epoch {epoch}: a sample read twice"
        assert set(ids) <= all_ids
        if epoch < unfinished:
            assert set(ids) == all_ids, f"epoch {epoch}: {len(all_ids - set(ids))} samples lost"
    return tagged


def _ids(logs) -> set[int]:
    return {f << 48 | r << 16 | k for f, r, k in logs[1]}


SMALL = {"shuffle_buffer": 6}  # windows of about 2 row groups


@pytest.mark.parametrize(
    ("world", "resumes", "options"),
    [
        (2, [(10, 3)], SMALL),
        (3, [(7, 2)], SMALL),
        (2, [(25, 1)], SMALL),
        (1, [(9, 4)], SMALL),
        (2, [(10, 3), (13, 1)], SMALL),  # the second resume while units are carried
        (2, [(10, 5)], SMALL),  # 24 row groups over 5 ranks: shares of unequal size
        (3, [(6, 2)], {"shuffle_buffer": 1000}),  # a window larger than a share
        (2, [(0, 3)], SMALL),  # at step 0: a fresh 3-rank run
        (3, [(8, 2)], {**SMALL, "shuffle": False}),
    ],
)
def test_another_world_size_loses_and_repeats_no_sample_of_an_epoch(logs, world, resumes, options):
    source = _source(logs[0], **options)
    segments = _segments(*resumes, world=world)
    resumed = source.with_segments(segments)
    steps = resumes[-1][0] + 60  # past the next epoch end at any world size
    _check(resumed, steps, 3, _ids(logs))
    first, world = segments[1][0] if len(segments) > 1 else steps, segments[0][1]
    for step in range(0, first, 4):  # up to the first resume: a run that never resumed
        for rank in range(world):
            want = source.batch(step, rank, world, 3).sample_id.tolist()
            assert resumed.batch(step, rank, world, 3).sample_id.tolist() == want


def test_a_unit_carried_twice_keeps_its_key(logs):
    """2 -> 3 at step 10, 3 -> 1 at step 11: the one new rank's stream holds
    units of the 2-rank run's windows, partly read by the 3-rank run."""
    resumed = _source(logs[0], shuffle_buffer=6).with_segments([(0, 2), (10, 3), (11, 1)])
    _check(resumed, 60, 3, _ids(logs))
    (last,) = resumed._plans[(resumed.segments, 3)][2]
    assert any(world == 2 and start > 0 for _, world, _, _, start in last.carried)


@pytest.mark.parametrize("ahead", [False, True])
def test_resume_at_an_epoch_end(logs, ahead):
    """Batch 1: resumed right where rank 0 ends epoch 0 (``ahead``: one step
    later, rank 0 already in epoch 1, rank 1 still in epoch 0)."""
    source = _source(logs[0], shuffle_buffer=6)
    end = next(s for s in range(200) if source.batch_epochs(s, 0, 2, 1)[0] == 1)
    assert source.batch_epochs(end, 1, 2, 1)[0] == 0  # the shares differ in size
    at = end + int(ahead)
    resumed = source.with_segments(_segments((at, 3), world=2))
    tagged = _check(resumed, at + 150, 1, _ids(logs))
    assert len(tagged) >= 3


def test_the_same_world_size_changes_nothing(logs):
    source = _source(logs[0], shuffle_buffer=6)
    segments = _segments((8, 2), (20, 2), world=2)
    assert segments == ((0, 2),)
    resumed = source.with_segments(segments)
    for step in (30, 8, 21, 55):
        for rank in range(2):
            got = resumed.batch(step, rank, 2, 3)
            want = source.batch(step, rank, 2, 3)
            assert got.sample_id.tolist() == want.sample_id.tolist()
            assert got.labels.tolist() == want.labels.tolist()
    fresh = source.with_segments(_segments((0, 3), world=2))  # step 0: a 3-rank run
    assert fresh.segments == ((0, 3),)
    want = source.batch(12, 2, 3, 3).sample_id.tolist()
    assert fresh.batch(12, 2, 3, 3).sample_id.tolist() == want


def test_segments_and_world_sizes_are_checked(logs):
    source = _source(logs[0], shuffle_buffer=6).with_segments([(0, 2), (5, 3)])
    with pytest.raises(ValueError, match="step 7 of this run is at world size 3, not 2"):
        source.batch(7, 0, 2, 3)
    with pytest.raises(ValueError, match="step 2 of this run is at world size 2, not 3"):
        source.batch(2, 0, 3, 3)
    with pytest.raises(ValueError, match="24 row groups for 30 ranks"):
        source.with_segments([(0, 30), (5, 3)]).check_world(3, 3)
    for bad in ([], [(1, 2)], [(0, 2), (0, 3)], [(0, 2), (5, 0)]):
        with pytest.raises(ValueError, match="segments must be"):
            check_segments(bad)


def test_the_source_a_resumed_run_gets(logs):
    """What `RunState.restore` does with a 2-rank checkpoint at step 5 in a
    1-rank run, and again with that run's checkpoint at step 9 in 3 ranks."""
    source = _source(logs[0], shuffle_buffer=6)
    position = DataPosition(5, 5 * 2 * 3, 2)
    at1, how = resumed_source(source, position, 1)
    assert (at1.segments, how) == (((0, 2), (5, 1)), "redealt")
    assert resume_record(position, how, 1) == {
        "step": 5, "from_world_size": 2, "samples_seen": 30, "data_position": "redealt",
        "segments": [[0, 2], [5, 1]],
    }  # fmt: skip
    at3, how = resumed_source(source, DataPosition(9, 42, 1, at1.segments), 3)
    assert (at3.segments, how) == (((0, 2), (5, 1), (9, 3)), "redealt")
    tagged = _check(at3, 50, 3, _ids(logs))
    assert tagged[0].total() == len(_ids(logs))
