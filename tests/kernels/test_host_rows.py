"""Gathers of host-memory rows (the host tier's reads) equal their torch twins.

On CUDA the source is pinned host memory read by the kernel over PCIe (UVA); on
CPU machines the kernel runs in Triton's interpreter. Rows move as words, so
every dtype is copied bit-exactly; the masked refresh leaves other rows alone.
An update through host pointers is `sparse_update`'s (tests/kernels/test_update.py
runs it; here once with a pinned weight on CUDA).
"""

import pytest
import torch

from freescale.kernels.host_rows import gather_host_rows, refresh_host_rows


def _host(rows: int, dim: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(rows * dim)
    host = torch.randn(rows, dim, generator=g).to(dtype)
    return host.pin_memory() if device == "cuda" else host


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "dim", "n"), [(50, 8, 37), (7, 3, 0), (300, 130, 257)])
def test_triton_gather_and_refresh_of_host_rows_match_the_twins(triton_device, dtype, rows, dim, n):
    host = _host(rows, dim, dtype, triton_device)
    index = torch.randint(0, rows, (n,), generator=torch.Generator().manual_seed(n))
    index = index.to(triton_device)
    want = host[index.cpu()]
    got = gather_host_rows(host, index, torch.device(triton_device), impl="triton")
    assert got.device.type == triton_device and torch.equal(got.cpu(), want)
    mask = (torch.arange(n) % 3 == 0).to(triton_device)
    out = torch.zeros(n, dim, dtype=dtype, device=triton_device)
    refresh_host_rows(host, index, mask, out, impl="triton")
    twin = torch.zeros(n, dim, dtype=dtype, device=triton_device)
    refresh_host_rows(host, index, mask, twin, impl="torch")
    assert torch.equal(out, twin)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned host memory needs CUDA")
def test_the_fused_update_writes_pinned_host_rows_as_device_rows():
    from freescale.kernels.triton_update import sparse_update

    device_w = torch.randn(64, 16, device="cuda")
    host_w = device_w.cpu().pin_memory()
    slots = torch.randint(0, 64, (200,), device="cuda")
    grads = torch.randn(200, 16, device="cuda")
    for w in (device_w, host_w):
        sparse_update(w, [], slots, grads, kind="sgd", lr=0.1, bc=(1.0, 1.0))
    torch.cuda.synchronize()
    assert torch.equal(device_w.cpu(), host_w)
