import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from freescale.embedding import RowSharding


@given(
    rows=st.integers(1, 300),
    world_size=st.integers(1, 9),
    kind=st.sampled_from(["hashed", "block"]),
    block_size=st.integers(1, 5),
)
def test_assignment_is_a_balanced_bijection(rows, world_size, kind, block_size):
    s = RowSharding(rows, world_size, kind, block_size)
    ids = torch.arange(rows)
    owner, slot = s.locate(ids)
    assert bool(((owner >= 0) & (owner < world_size)).all())
    assert bool(((slot >= 0) & (slot < s.local_rows)).all())
    # No two ids share a (rank, slot): a bijection onto the non-padding slots.
    assert torch.unique(owner * s.local_rows + slot).numel() == rows
    for r in range(world_size):
        held = s.global_ids(r)
        mine = ids[owner == r]
        assert torch.equal(held[held >= 0].sort().values, mine)
        assert torch.equal(held[slot[mine]], mine)  # global_ids inverts locate
    if kind == "hashed":
        counts = torch.bincount(owner, minlength=world_size)
        assert int(counts.max() - counts.min()) <= block_size * 2


def test_consecutive_hot_ids_spread_over_ranks():
    s = RowSharding(10**6, 8, "hashed", 1)
    owner, _ = s.locate(torch.arange(1000, 1008))
    assert sorted(owner.tolist()) == list(range(8))
    # Strided ids (a pattern that defeats round-robin) are spread too.
    owner, _ = s.locate(torch.arange(0, 8 * 4000, 8))
    counts = torch.bincount(owner, minlength=8)
    assert int(counts.min()) > 350, counts
    # The block assignment keeps consecutive ids together (the thing hashing avoids).
    owner, _ = RowSharding(10**6, 8, "block").locate(torch.arange(1000, 1008))
    assert owner.unique().numel() == 1


def test_invalid_ids_still_get_a_valid_owner():
    for kind in ("hashed", "block"):
        owner, _ = RowSharding(10, 3, kind).locate(torch.tensor([-5, -1, 10, 2**40]))
        assert bool(((owner >= 0) & (owner < 3)).all())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rows": 0, "world_size": 1},
        {"rows": 5, "world_size": 0},
        {"rows": 5, "world_size": 1, "kind": "random"},
        {"rows": 5, "world_size": 1, "block_size": 0},
    ],
)
def test_invalid_configs(kwargs):
    with pytest.raises(ValueError):
        RowSharding(**kwargs)
