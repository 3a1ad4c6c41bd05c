"""`host_to_device`: values arrive unchanged, on CPU and (marked gpu) CUDA."""

import pytest
import torch

from freescale.jagged.ops import host_to_device


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
