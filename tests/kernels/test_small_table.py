"""The small-table weight gradient (Triton) against its index_add reference,
and `SmallEmbedding` against ``nn.Embedding``."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.kernels.small_table import MAX_ROWS, column_sums, small_table_grad
from freescale.models.small_embedding import SmallEmbedding
from freescale.testing.tolerance import random_sum_size, reduction_tol


def row_sums_tol(grad, ids, rows: int) -> dict[str, float]:
    """Two orders of the fp32 per-row sums ``out[ids[i]] += grad[i]``: the
    busiest row's count of terms and absolute sum (or, smaller for long sums,
    the partial-sum size of random terms: the data are ``randn``); one ulp
    more when the sums are stored in a narrower dtype."""
    narrow = grad.dtype if grad.dtype != torch.float32 else None
    ids, grad = ids.to(torch.int64).cpu(), grad.cpu().double()
    terms = max(1, int(torch.bincount(ids, minlength=rows).max()) if ids.numel() else 1)
    size = torch.zeros(rows, grad.shape[1], dtype=torch.float64).index_add_(0, ids, grad.abs())
    rms = float(grad.pow(2).mean().sqrt()) if grad.numel() else 0.0
    size = min(float(size.max()), random_sum_size(terms, rms))
    return reduction_tol(torch.float32, terms, size, output=narrow)


def column_sums_tol(x) -> dict[str, float]:
    """`row_sums_tol` of one row that every row of ``x`` adds to."""
    return row_sums_tol(x, torch.zeros(x.shape[0], dtype=torch.int64), 1)


@pytest.mark.numeric
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, MAX_ROWS), dim=st.sampled_from([1, 3, 32, 33, 70]),
       n=st.integers(0, 300), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_triton_equals_reference_to_rounding(triton_device, rows, dim, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(n, dim, generator=g).to(dtype)
    ids = torch.randint(0, rows, (n,), generator=g)
    want = small_table_grad(grad, ids, rows, impl="torch")
    got = small_table_grad(grad.to(triton_device), ids.to(triton_device), rows, impl="triton")
    assert got.dtype == dtype and got.shape == (rows, dim)
    tol = row_sums_tol(grad, ids, rows)
    torch.testing.assert_close(got.cpu().float(), want.float(), **tol)
    again = small_table_grad(grad.to(triton_device), ids.to(triton_device), rows, impl="triton")
    assert torch.equal(got, again)  # same order every run: same bits


def test_one_contribution_per_row_is_exact_and_unused_rows_are_zero(triton_device):
    grad = torch.randn(5, 7)
    ids = torch.tensor([4, 0, 2, 6, 1])  # rows 3 and 5 unused
    got = small_table_grad(grad.to(triton_device), ids.to(triton_device), 8, impl="triton").cpu()
    want = torch.zeros(8, 7)
    want[ids] = grad
    assert torch.equal(got, want)


@pytest.mark.numeric
def test_int32_ids_and_long_inputs_span_many_programs(triton_device):
    g = torch.Generator().manual_seed(3)
    n = 70_000  # 4 columns: one program per 512 positions, 137 of them
    grad = torch.randn(n, 4, generator=g)
    ids = torch.randint(0, 3, (n,), generator=g, dtype=torch.int32)
    want = small_table_grad(grad, ids, 3, impl="torch")
    got = small_table_grad(grad.to(triton_device), ids.to(triton_device), 3, impl="triton")
    torch.testing.assert_close(got.cpu(), want, **row_sums_tol(grad, ids, 3))


def test_programs_that_loop_over_several_tiles(triton_device):
    """32 rows x 128 columns: tiles of 2 positions, so each program adds 5 tiles."""
    g = torch.Generator().manual_seed(4)
    grad = torch.randn(5000, 128, generator=g)
    ids = torch.randint(0, 32, (5000,), generator=g)
    want = small_table_grad(grad, ids, 32, impl="torch")
    got = small_table_grad(grad.to(triton_device), ids.to(triton_device), 32, impl="triton")
    torch.testing.assert_close(got.cpu(), want, **row_sums_tol(grad, ids, 32))


def test_a_non_finite_gradient_reaches_its_own_row_only(triton_device):
    grad = torch.ones(6, 3)
    grad[2, 1] = float("inf")
    ids = torch.tensor([0, 1, 1, 0, 2, 1])
    got = small_table_grad(grad.to(triton_device), ids.to(triton_device), 3, impl="triton").cpu()
    assert torch.equal(got[0], torch.full((3,), 2.0)) and torch.equal(got[2], torch.ones(3))
    assert got[1, 1] == float("inf") and torch.equal(got[1, [0, 2]], torch.full((2,), 3.0))


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="rows"):
        small_table_grad(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64), MAX_ROWS + 1)
    with pytest.raises(ValueError, match="need grad"):
        small_table_grad(torch.zeros(2, 3), torch.zeros(3, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="integers"):
        small_table_grad(torch.zeros(2, 3), torch.zeros(2), 4)
    with pytest.raises(ValueError, match="on meta"):
        small_table_grad(torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64, device="meta"), 4)


@pytest.mark.numeric
@pytest.mark.parametrize("shape", [(0,), (9,), (3, 4)])
def test_small_embedding_matches_nn_embedding(triton_device, monkeypatch, shape):
    """Forward bitwise, weight gradient to rounding, on the Triton path (forced
    on CPU tensors under the interpreter); the CPU path is nn.Embedding itself."""
    torch.manual_seed(0)
    plain = torch.nn.Embedding(5, 6)
    small = SmallEmbedding(5, 6)
    small.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 5, shape)
    up = torch.randn(*shape, 6)
    ref = plain(ids)
    (ref * up).sum().backward()
    monkeypatch.setenv("FREESCALE_KERNELS", "triton")
    small = small.to(triton_device)
    out = small(ids.to(triton_device))
    assert torch.equal(out.cpu(), ref.detach())
    (out * up.to(triton_device)).sum().backward()
    tol = row_sums_tol(up.reshape(-1, 6), ids.reshape(-1), 5)
    torch.testing.assert_close(small.weight.grad.cpu(), plain.weight.grad, **tol)


def test_small_embedding_falls_back_to_nn_embedding_where_it_must():
    fp64 = SmallEmbedding(4, 2, dtype=torch.float64)
    for m in (SmallEmbedding(MAX_ROWS + 1, 2), SmallEmbedding(4, 2, padding_idx=0), fp64):
        assert m._plain()
    assert not SmallEmbedding(MAX_ROWS, 2)._plain()


@pytest.mark.numeric
@settings(max_examples=15, deadline=None)
@given(rows=st.integers(0, 3000), dim=st.sampled_from([1, 5, 32, 96]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_column_sums_equal_reference_to_rounding(triton_device, rows, dim, dtype, seed):
    x = torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed)).to(dtype)
    want = column_sums(x, impl="torch")
    got = column_sums(x.to(triton_device), impl="triton")
    assert got.dtype == dtype and got.shape == (dim,)
    torch.testing.assert_close(got.cpu().float(), want.float(), **column_sums_tol(x))
    assert torch.equal(got, column_sums(x.to(triton_device), impl="triton"))


@pytest.mark.numeric
def test_column_sums_of_programs_that_loop_over_several_tiles(triton_device):
    """70,000 x 128: 365 programs of 3 tiles of 64 rows (the bias gradient's shape class)."""
    x = torch.randn(70_000, 128, generator=torch.Generator().manual_seed(5))
    got = column_sums(x.to(triton_device), impl="triton").cpu()
    torch.testing.assert_close(got, column_sums(x, impl="torch"), **column_sums_tol(x))


@pytest.mark.numeric
def test_wide_rows_span_several_column_blocks(triton_device):
    """300 columns: three column blocks of 128, the last one partial."""
    g = torch.Generator().manual_seed(6)
    grad = torch.randn(900, 300, generator=g)
    ids = torch.randint(0, 5, (900,), generator=g)
    got = small_table_grad(grad.to(triton_device), ids.to(triton_device), 5, impl="triton")
    want = small_table_grad(grad, ids, 5, impl="torch")
    torch.testing.assert_close(got.cpu(), want, **row_sums_tol(grad, ids, 5))
    sums = column_sums(grad.to(triton_device), impl="triton").cpu()
    torch.testing.assert_close(sums, column_sums(grad, impl="torch"), **column_sums_tol(grad))
