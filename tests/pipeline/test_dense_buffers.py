"""Buffers a model updates in forward (running statistics) are rank 0's on every
rank before each training forward, as under DDP: ranks never drift apart."""

import torch
import torch.distributed as dist
from torch import nn

from freescale.pipeline.dense import DenseSync
from freescale.testing import run_ranks


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)  # running_mean / running_var / num_batches_tracked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def _buffers_after_share(_: int) -> list[list[torch.Tensor]]:
    torch.manual_seed(0)
    model = _Norm()
    sync = DenseSync(model, lambda: (0, None))
    out = []
    for step in range(2):
        sync.share_buffers()
        out.append([b.clone() for b in model.buffers()])
        torch.manual_seed(100 * step + dist.get_rank())  # each rank its own batch
        model(torch.randn(8, 4) * (1 + dist.get_rank()))  # moves the running stats apart
    return out


def test_rank_0_buffers_reach_every_rank_before_each_forward():
    got = run_ranks(_buffers_after_share, 3, 0)
    for step in range(2):
        for rank in (1, 2):
            for a, b in zip(got[0][step], got[rank][step], strict=True):
                assert torch.equal(a, b), (step, rank)
    # the forwards did move them: the check is not of untouched buffers
    assert not torch.equal(got[0][0][0], got[0][1][0])
