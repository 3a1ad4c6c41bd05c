import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from freescale.embedding._ops import (
    CHUNK,
    first_bad,
    segment_sum,
    sum_duplicates,
)
from freescale.testing.tolerance import random_sum_size, reduction_tol

pytestmark = pytest.mark.numeric  # sums whose order is part of the contract


@given(st.lists(st.integers(0, 6), max_size=30))
def test_sum_duplicates_matches_a_loop(rows):
    r = torch.tensor(rows, dtype=torch.int64)
    g = torch.randn(len(rows), 3, dtype=torch.float64).to(torch.bfloat16)
    unique, summed = sum_duplicates(r, g)
    assert unique.tolist() == sorted(set(rows))
    assert summed.dtype == torch.float32
    for u, s in zip(unique.tolist(), summed, strict=True):
        acc = torch.zeros(3)
        for i, row in enumerate(rows):  # arrival order
            if row == u:
                acc += g[i].float()
        assert torch.equal(s, acc)


def test_first_bad():
    has, value = first_bad(torch.tensor([3, 9, -1, 12]), 10)
    assert bool(has) and int(value) == -1
    has, _ = first_bad(torch.tensor([0, 9]), 10)
    assert not bool(has)


@pytest.mark.parametrize("chunk", [None, CHUNK, 3])
def test_hot_rows_are_summed_exactly_and_reproducibly(chunk):
    g = torch.Generator().manual_seed(0)
    rows = torch.cat(
        [torch.zeros(5000, dtype=torch.int64), torch.arange(1, 40), torch.full((33,), 7)]
    )
    rows = rows[torch.randperm(rows.numel(), generator=g)]
    grads = torch.randn(rows.numel(), 4, generator=g, dtype=torch.float64)
    sorted_rows, order = torch.sort(rows, stable=True)
    unique, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    summed = segment_sum(grads.float()[order], counts, chunk)
    assert unique.tolist() == list(range(40))
    expect = torch.zeros(40, 4, dtype=torch.float64).index_add_(0, rows, grads)
    # fp32 chunked sums of randn terms against float64 ones: the hot row's terms.
    terms = int(counts.max())
    tol = reduction_tol(torch.float32, terms, random_sum_size(terms, float(grads.std())))
    torch.testing.assert_close(summed.double(), expect, **tol)
    assert torch.equal(summed, segment_sum(grads.float()[order], counts, chunk))


def test_segment_sum_order_is_chunked_sequential():
    x = torch.tensor([1e8, 1.0, -1e8, 1.0] * 20, dtype=torch.float32)[:, None]
    lengths = torch.tensor([80])
    # Chunks of 32: [1e8, 1, -1e8, 1, ...] each sum sequentially in fp32.
    chunk_sums = []
    for start in range(0, 80, CHUNK):
        acc = torch.zeros(1)
        for v in x[start : start + CHUNK]:
            acc = acc + v
        chunk_sums.append(acc)
    total = torch.zeros(1)
    for c in chunk_sums:
        total = total + c
    assert torch.equal(segment_sum(x, lengths, CHUNK)[0], total)
    # Sequential in one pass: 1e8 + 1 - 1e8 + 1 + ... loses every other 1.
    assert float(segment_sum(x, lengths, None)[0, 0]) == 1.0
