import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.kernels import collision_split
from freescale.kernels.collision import collision_split_eager, collision_split_reference

from .strategies import ID_DTYPES, NUM_ROWS, same

row_sets = st.sets(st.integers(0, NUM_ROWS - 1) | st.sampled_from([0, NUM_ROWS - 1]), max_size=30)


def as_rows(rows: set[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(sorted(rows), dtype=torch.int64).to(dtype)


def assert_same_maps(a, b) -> None:
    assert same(a.now_to_next, b.now_to_next)
    assert same(a.next_to_now, b.next_to_now)


@settings(max_examples=80, deadline=None)
@given(now=row_sets, nxt=row_sets, dtype=st.sampled_from(ID_DTYPES))
def test_reference_matches_set_algebra(now, nxt, dtype):
    split = collision_split_reference(as_rows(now, dtype), as_rows(nxt, dtype))
    assert split.collision_rows().tolist() == sorted(now & nxt)
    assert split.exclusive_now_rows().tolist() == sorted(now - nxt)
    assert split.exclusive_next_rows().tolist() == sorted(nxt - now)
    c_now, c_next = split.collision()
    assert same(split.rows_now[c_now], split.rows_next[c_next])  # aligned
    assert same(split.next_to_now[c_next], c_now)
    assert_same_maps(collision_split_eager(split.rows_now, split.rows_next), split)


@settings(max_examples=30, deadline=None)
@given(now=row_sets, nxt=row_sets, dtype=st.sampled_from(ID_DTYPES))
def test_triton_equals_reference(triton_device, now, nxt, dtype):
    a, b = as_rows(now, dtype), as_rows(nxt, dtype)
    want = collision_split_reference(a, b)
    got = collision_split(a.to(triton_device), b.to(triton_device), impl="triton")
    assert_same_maps(got, want)


def test_collision_across_triton_blocks(triton_device):
    """Sets larger than one program's block, with the last row colliding."""
    now = torch.arange(0, 3000, 2)
    nxt = torch.cat([torch.arange(1, 2999, 3), torch.tensor([2998])])
    want = collision_split_reference(now, nxt)
    got = collision_split(now.to(triton_device), nxt.to(triton_device), impl="triton")
    assert_same_maps(got, want)
    assert 2998 in got.collision_rows().tolist()


def test_validation():
    with pytest.raises(ValueError, match="dtype"):
        collision_split(torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="1-D integer"):
        collision_split(torch.zeros(2), torch.zeros(2))


slot_lists = st.lists(st.integers(0, 40) | st.sampled_from([0, 40]), max_size=70)


def assert_same_marks(slots_now: torch.Tensor, slots_next: torch.Tensor, device) -> None:
    from freescale.embedding.collision_link import owner_marks

    want = owner_marks(slots_now, slots_next, impl="torch")
    got = owner_marks(slots_now.to(device), slots_next.to(device), impl="triton")
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g.cpu(), w), (g, w)


@settings(max_examples=40, deadline=None)
@given(now=slot_lists, nxt=slot_lists)
def test_owner_marks_triton_equals_torch(triton_device, now, nxt):
    """Unsorted slots with repeats (empty steps too): marks and stats."""
    assert_same_marks(torch.tensor(now, dtype=torch.int64), torch.tensor(nxt, dtype=torch.int64),
                      triton_device)  # fmt: skip


def test_owner_marks_triton_across_blocks(triton_device):
    """More slots than one program's block on both sides, runs across block edges."""
    g = torch.Generator().manual_seed(3)
    now = torch.randint(0, 900, (1300,), generator=g)
    nxt = torch.cat([torch.randint(500, 2000, (1100,), generator=g), torch.full((40,), 899)])
    assert_same_marks(now, nxt[torch.randperm(nxt.numel(), generator=g)], triton_device)
