"""The run's segments (world sizes by step): how a resume extends them, what the
manifest records (older manifests: one segment), and which source gets them."""

from pathlib import Path

import pytest
import torch
from torch import nn

from freescale.state.checkpoint import Checkpointer
from freescale.state.checkpoint_files import check_manifest
from freescale.state.position import DataPosition, add_segment, resume_record, resumed_source


def test_a_resume_adds_a_segment_only_at_another_world_size():
    assert add_segment(((0, 2),), 5, 2) == ((0, 2),)
    assert add_segment(((0, 2),), 5, 3) == ((0, 2), (5, 3))
    assert add_segment(((0, 2),), 0, 3) == ((0, 3),)  # nothing ran at 2 ranks
    assert add_segment(((0, 2), (5, 3)), 9, 1) == ((0, 2), (5, 3), (9, 1))
    assert add_segment(((0, 2), (5, 3)), 5, 2) == ((0, 2),)  # 2 -> 3 -> 2, nothing at 3
    assert add_segment(((0, 2), (5, 3)), 5, 4) == ((0, 2), (5, 4))
    fresh = DataPosition(world_size=2)
    assert fresh.history() == ((0, 2),) and fresh.continued(2) == ((0, 2),)
    assert DataPosition(5, 40, 2, ((0, 2),)) == DataPosition(5, 40, 2)  # one spelling
    assert DataPosition(9, 0, 3, ((0, 2), (5, 3))).continued(1) == ((0, 2), (5, 3), (9, 1))


class _Streamed:
    def with_segments(self, segments):
        out = _Streamed()
        out.segments = segments
        return out


class _Numbered:
    def starting_at(self, step, position):
        return ("at", step, position)


def test_each_kind_of_source_continues_its_own_way():
    position = DataPosition(5, 40, 2)
    source, how = resumed_source(_Streamed(), position, 3)
    assert (source.segments, how) == (((0, 2), (5, 3)), "redealt")
    assert resume_record(position, how, 3)["segments"] == [[0, 2], [5, 3]]
    source, how = resumed_source(_Streamed(), position, 2)
    assert (source.segments, how) == (((0, 2),), "sample")
    assert "segments" not in resume_record(position, how, 2)
    assert resumed_source(_Numbered(), position, 3) == (("at", 5, 40), "sample")
    plain = object()
    assert resumed_source(plain, position, 3) == (plain, "step")


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_manifest_records_the_segments(tmp_path):
    tables, dense = nn.Embedding(5, 2), nn.Linear(2, 1)
    replicated = {"model": dense, "optimizer": torch.optim.SGD(dense.parameters(), lr=0.1)}
    checkpoints = Checkpointer(str(tmp_path), every=1, keep=1, config={})
    path = checkpoints.save(9, tables, replicated, 96, ((0, 2), (5, 4), (7, 1)))
    got = checkpoints.load(path, tables, replicated)
    assert got == DataPosition(9, 96, 1, ((0, 2), (5, 4), (7, 1)))


def test_older_and_malformed_segments(tmp_path):
    where = Path(tmp_path / "manifest.json")
    manifest = {"format": 3, "step": 5, "world_size": 2, "samples_seen": 80, "config": {}}
    manifest["files"] = {}
    check_manifest(manifest, where)  # no segments: one, at world size 2
    for good in ([[0, 2]], [[0, 3], [5, 2]]):
        check_manifest({**manifest, "segments": good}, where)
    bad = [[], [[1, 2]], [[0, 3]], [[0, 2], [6, 2]], [[0, 1], [0, 2]], [[0, 0], [3, 2]]]
    bad += [[[0, True]], [[0, 2.0]], [(0, 2)], "0:2"]
    for segments in bad:
        with pytest.raises(ValueError, match=r"malformed .*segments"):
            check_manifest({**manifest, "segments": segments}, where)


def test_samples_before_a_step_follow_each_segments_world_size():
    # 4 steps at 1 rank, then 6 at 2 ranks (batch 8): 32 + 96 samples before step 10
    pos = DataPosition(step=10, samples=128, world_size=2, segments=((0, 1), (4, 2)))
    assert [pos.samples_at(s, 3, 8) for s in (0, 2, 4, 6, 10, 12)] == [0, 16, 32, 64, 128, 176]
