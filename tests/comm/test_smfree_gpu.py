"""smfree on CUDA (run on the GPU machine; skipped without CUDA).

Ranks are `run_ranks` processes (gloo default group; smfree needs no NCCL),
on GPU ``rank % device_count``, so one GPU suffices. Checks: results equal the
torch backend's (gloo, CPU); the producer's stream order is honoured; the
profiler sees only memcpys, no kernel, for the data movement.
"""

import pytest
import torch
import torch.distributed as dist

from freescale.comm import make_communicator
from freescale.testing import run_ranks
from tests.comm._smfree_cases import compare

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize(
    ("backend", "ranks_per_host"), [("smfree-shm", None), ("smfree-gloo", None), ("smfree-hier", 2)]
)
def test_cuda_smfree_equals_torch_backend(backend, ranks_per_host):
    for info in run_ranks(compare, 4, backend, ranks_per_host, "cuda", timeout=300):
        assert info["diff"] == [], info


def _ordered_and_kernel_free(backend: str) -> dict:
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    comm = make_communicator(backend, "cuda", pool_bytes=1 << 20)
    r, w = comm.rank, comm.world_size
    x = torch.zeros(1 << 20, device="cuda")  # 4 MiB: several chunks
    send = [x.numel() // w] * w
    comm.all_gather(x).wait()  # warm-up: buffers, registration
    torch.cuda.synchronize()
    # The producer is still running when the collectives are issued.
    torch.cuda._sleep(200_000_000)
    x.fill_(r + 1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        gathered = comm.all_gather(x).wait()
        swapped = comm.all_to_all_v(x, send, send).wait()
        torch.cuda.synchronize()
    want = torch.cat([torch.full((x.numel(),), s + 1.0) for s in range(w)])
    device_ops = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    comm.close()
    return {
        "gather_ok": torch.equal(gathered.cpu(), want),
        "a2a_ok": torch.equal(
            swapped.cpu(), torch.cat([torch.full((send[0],), s + 1.0) for s in range(w)])
        ),
        "not_memcpy": sorted(n for n in device_ops if not n.startswith("Memcpy")),
    }


@pytest.mark.parametrize("backend", ["smfree-shm", "smfree-gloo"])
def test_cuda_producer_order_and_no_kernels(backend):
    for info in run_ranks(_ordered_and_kernel_free, 2, backend, timeout=300):
        assert info["gather_ok"] and info["a2a_ok"], info
        assert info["not_memcpy"] == [], info
