"""`host_to_device`: values arrive unchanged, on CPU and (marked gpu) CUDA;
`segment_ids` against a list reference."""

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from freescale.jagged.ops import host_to_device, segment_ids


def test_host_to_device_on_cpu_is_the_tensor():
    t = torch.arange(5)
    assert torch.equal(host_to_device(t, torch.device("cpu")), t)


@pytest.mark.gpu
def test_host_to_device_queues_a_pinned_copy():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=dev)
    for _ in range(20):  # keep the stream busy so a blocking copy would wait
        busy = busy @ busy / 4096
    t = torch.arange(1000, dtype=torch.int64)
    out = host_to_device(t, dev)
    assert out.device.type == "cuda" and torch.equal(out.cpu(), t)


@given(
    st.lists(st.integers(0, 5), min_size=0, max_size=12),
    st.sampled_from([torch.int64, torch.int32]),
)
def test_segment_ids_name_each_position_s_segment(lengths, dtype):
    """Empty segments own no position; no segments, no positions."""
    offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=dtype)
    want = [i for i, n in enumerate(lengths) for _ in range(n)]
    got = segment_ids(offsets)
    assert got.dtype == torch.int64 and got.tolist() == want
    assert segment_ids(offsets, len(want)).tolist() == want
