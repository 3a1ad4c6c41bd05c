"""The sync-free collision marks equal their ``torch.unique`` twin on random slots."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.embedding.collision_link import (
    fill_marked,
    marked_first,
    owner_marks,
    owner_marks_reference,
    split_marked,
    sum_per_peer,
    sums_per_peer,
)

slots = st.lists(st.integers(0, 40), max_size=60).map(lambda v: torch.tensor(v, dtype=torch.int64))


@settings(max_examples=200, deadline=None)
@given(now=slots, nxt=slots)
def test_owner_marks_match_the_unique_reference(now, nxt):
    got = owner_marks(now, nxt)
    want = owner_marks_reference(now, nxt)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w), (g, w)


@settings(max_examples=100, deadline=None)
@given(mark=st.lists(st.booleans(), max_size=30))
def test_fill_marked_replaces_the_marked_rows_in_order(mark):
    mark_t = torch.tensor(mark, dtype=torch.bool)
    full = torch.arange(len(mark), dtype=torch.float32).unsqueeze(1)
    on_marked = -1.0 - torch.arange(int(mark_t.sum()), dtype=torch.float32).unsqueeze(1)
    out = fill_marked(mark_t, on_marked, full)
    assert torch.equal(out[mark_t], on_marked)
    assert torch.equal(out[~mark_t], full[~mark_t])


@settings(max_examples=100, deadline=None)
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=5), data=st.data())
def test_sum_per_peer_counts_marks_in_each_peers_range(counts, data):
    mark = torch.tensor(data.draw(st.lists(st.booleans(), min_size=sum(counts),
                                           max_size=sum(counts))), dtype=torch.bool)  # fmt: skip
    want, start = [], 0
    for c in counts:
        want.append(int(mark[start : start + c].sum()))
        start += c
    assert sum_per_peer(mark, counts).tolist() == want


@settings(max_examples=100, deadline=None)
@given(
    layouts=st.lists(st.lists(st.integers(0, 6), min_size=3, max_size=3), min_size=1, max_size=4),
    data=st.data(),
)
def test_sums_per_peer_of_several_marks_equal_one_at_a_time(layouts, data):
    """The four marks of a link summed in one pass (empty buffers and peers included)."""
    marks = [
        torch.tensor(data.draw(st.lists(st.booleans(), min_size=sum(c), max_size=sum(c))),
                     dtype=torch.bool)
        for c in layouts
    ]  # fmt: skip
    got = sums_per_peer(marks, layouts)
    assert got.shape == (len(marks), 3)
    for row, mark, counts in zip(got.tolist(), marks, layouts, strict=True):
        want, start = [], 0
        for c in counts:
            want.append(int(mark[start : start + c].sum()))
            start += c
        assert row == want


@settings(max_examples=100, deadline=None)
@given(mark=st.lists(st.booleans(), max_size=30))
def test_split_marked_keeps_order_and_a_given_order_is_the_same(mark):
    mark_t = torch.tensor(mark, dtype=torch.bool)
    x = torch.arange(len(mark), dtype=torch.float32).unsqueeze(1) * 3
    marked = int(mark_t.sum())
    co, ex = split_marked(x, mark_t, marked)
    assert torch.equal(co, x[mark_t]) and torch.equal(ex, x[~mark_t])
    order = marked_first(mark_t)
    co2, ex2 = split_marked(x, mark_t, marked, order)
    assert torch.equal(co, co2) and torch.equal(ex, ex2)
    on = -x[mark_t]
    assert torch.equal(fill_marked(mark_t, on, x), fill_marked(mark_t, on, x, order))
