import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.kernels import gather_rows

from .strategies import same


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), dim=st.sampled_from([1, 3, 8, 33]), n=st.integers(0, 60),
       seed=st.integers(0, 2**16))  # fmt: skip
def test_triton_gather_equals_reference(triton_device, rows, dim, n, seed):
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(rows, dim, generator=g)
    index = torch.randint(0, rows, (n,), generator=g)  # repeats included
    want = gather_rows(table, index, impl="torch")
    assert same(want, table[index])
    got = gather_rows(table.to(triton_device), index.to(triton_device), impl="triton")
    assert same(got, want)


def test_gather_rejects_bad_shapes():
    with pytest.raises(ValueError):
        gather_rows(torch.zeros(3, 2), torch.zeros(2, 2, dtype=torch.int64))
