"""Rank bodies shared by the smfree tests: every case through smfree and torch, compared.

`compare(backend, ranks_per_host)` runs on each rank of `run_ranks` (or of a
torchrun launch): it builds the smfree communicator and a
`TorchCommunicator`, runs the shared first-principles cases
(`_cases.exercise`) and large, uneven, multi-dtype collectives (several in
flight at once, larger than the pool so that chunking runs) through both,
and returns what differed (nothing, if correct) with a few facts about the run.
"""

from __future__ import annotations

import torch
from torch import Tensor

from freescale.comm import Communicator, TorchCommunicator, make_communicator
from tests.comm._cases import exercise

POOL = 64 << 10  # small pool: the large cases below span many chunks
DTYPES = (torch.float32, torch.int64, torch.bfloat16)


def _rows(rank: int, n: int, width: int, dtype: torch.dtype, salt: int) -> Tensor:
    g = torch.Generator().manual_seed(1000 * rank + salt)
    if dtype.is_floating_point:
        return torch.randn(n, width, generator=g).to(dtype)
    return torch.randint(-(2**62), 2**62, (n, width), generator=g, dtype=dtype)


def large_cases(comm: Communicator) -> dict[str, Tensor]:
    """Issue everything first, then wait: several collectives in flight."""
    r, w, dev = comm.rank, comm.world_size, comm.device
    works = {}
    for i, dtype in enumerate(DTYPES):
        # AllGather larger than the pool: ~96 KiB per rank.
        works[f"gather-{dtype}"] = comm.all_gather(_rows(r, 3000 + i, 4, dtype, i).to(dev))
        # Uneven AllToAll: rank r sends to d 0, a few, or many rows (> pool).
        send = [((r + d + i) % 3) * (1500 + 7 * d) for d in range(w)]
        recv = [((s + r + i) % 3) * (1500 + 7 * r) for s in range(w)]
        x = _rows(r, sum(send), 5, dtype, 10 + i).to(dev)
        works[f"a2a-{dtype}"] = comm.all_to_all_v(x, send, recv)
    works["zero-gather"] = comm.all_gather(torch.empty(0, 3, dtype=torch.int64, device=dev))
    works["one-row"] = comm.all_to_all_v(torch.full((w, 1), float(r), device=dev), [1] * w, [1] * w)
    cube = torch.arange(2 * 3 * 4, dtype=torch.float32, device=dev).view(2, 3, 4) + r
    works["3d"] = comm.all_gather(cube)
    return {k: v.wait().cpu() for k, v in works.items()}


def compare(backend: str, ranks_per_host: int | None = None, device: str = "cpu") -> dict:
    """smfree on ``device`` against the torch backend on the CPU (gloo)."""
    if device == "cuda":
        torch.cuda.set_device(torch.distributed.get_rank() % torch.cuda.device_count())
    comm = make_communicator(backend, device, pool_bytes=POOL, ranks_per_host=ranks_per_host)
    ref = TorchCommunicator(device="cpu")
    got = {k: v.cpu() for k, v in {**exercise(comm), **large_cases(comm)}.items()}
    want = {**exercise(ref), **large_cases(ref)}
    diff = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    info = {
        "diff": diff,
        "keys": len(want),
        "transport": comm.transport.name,
        "chunk": comm.transport.chunk_bytes,
        "largest": max(v.numel() * v.element_size() for v in want.values()),
    }
    comm.close()
    return info
