"""Collective cases shared by the fake and torch backend tests.

`exercise(comm)` runs several collectives through the `Communicator`
interface only and returns what this rank received; `expected(rank, W)`
computes the same from first principles.
"""

from __future__ import annotations

import torch
from torch import Tensor

from freescale.comm import Communicator, exchange_counts


def send_counts(rank: int, world_size: int) -> list[int]:
    """Uneven, with zeros, and not symmetric: rank r sends (2r + d) % 3 rows to
    rank d, which sends (2d + r) % 3 back (symmetric counts would hide send and
    receive counts used the wrong way round)."""
    return [(2 * rank + d) % 3 for d in range(world_size)]


def rows_of(rank: int, world_size: int, dtype: torch.dtype) -> Tensor:
    n = sum(send_counts(rank, world_size))
    base = torch.arange(n * 2, dtype=torch.float64).reshape(n, 2) + 1000 * rank
    return base.to(dtype)


def exercise(comm: Communicator) -> dict[str, Tensor]:
    r, w = comm.rank, comm.world_size
    send = send_counts(r, w)
    counts = exchange_counts(comm, torch.tensor(send, device=comm.device)).wait()
    recv = counts.tolist()
    out = {"counts": counts.cpu()}
    # Issue several collectives before waiting on any: handles are independent.
    works = {
        str(dtype): comm.all_to_all_v(rows_of(r, w, dtype).to(comm.device), send, recv)
        for dtype in (torch.float32, torch.int64, torch.bfloat16)
    }
    works["gather"] = comm.all_gather(torch.full((2, 3), float(r), device=comm.device))
    empty = torch.empty(0, 5, device=comm.device)
    works["empty"] = comm.all_to_all_v(empty, [0] * w, [0] * w)
    # Several counts exchanges at once ([W, K]).
    both = torch.tensor([[c, 10 * c] for c in send], device=comm.device)
    works["counts2"] = exchange_counts(comm, both)
    out.update({k: v.wait().cpu() for k, v in works.items()})
    return out


def expected(rank: int, world_size: int) -> dict[str, Tensor]:
    recv = [send_counts(s, world_size)[rank] for s in range(world_size)]
    out = {"counts": torch.tensor(recv)}
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        pieces = []
        for s in range(world_size):
            counts = send_counts(s, world_size)
            start = sum(counts[:rank])
            pieces.append(rows_of(s, world_size, dtype)[start : start + counts[rank]])
        out[str(dtype)] = torch.cat(pieces)
    out["gather"] = torch.cat([torch.full((2, 3), float(s)) for s in range(world_size)])
    out["empty"] = torch.empty(0, 5)
    out["counts2"] = torch.tensor([[c, 10 * c] for c in recv])
    return out


def assert_expected(per_rank: list[dict[str, Tensor]]) -> None:
    w = len(per_rank)
    for rank, got in enumerate(per_rank):
        want = expected(rank, w)
        assert set(got) == set(want)
        for key, value in want.items():
            assert got[key].dtype == value.dtype, key
            assert torch.equal(got[key], value), (rank, key)
