"""Prioritized updates on CUDA (the Triton update, NCCL): bit-identical to sync.

World size 1 per GPU count available (one rank per GPU, NCCL). The same
scenario as tests/embedding/test_prioritized.py: every optimizer, collision
rates 0-100 %, prefetch before/after forward, a skipped prefetch, a flush and
an evaluation lookup mid-run.
"""

import pytest
import torch
import torch.distributed as dist

from freescale.comm import TorchCommunicator
from freescale.testing import run_ranks
from tests.embedding._train import unpack
from tests.embedding.test_prioritized import OPTIMIZERS, RATES, _assert_equal_runs, parity_runs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _cuda_parity_rank(world_size: int) -> bytes:
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    comm = TorchCommunicator(group=dist.new_group(backend="nccl"), device="cuda")
    return parity_runs(comm, world_size)


def test_prioritized_is_bit_identical_to_sync_on_cuda():
    world_size = 2 if torch.cuda.device_count() >= 2 else 1
    per_rank = [unpack(r) for r in run_ranks(_cuda_parity_rank, world_size, world_size,
                                             timeout=300)]  # fmt: skip
    for rate in RATES:
        for opt in OPTIMIZERS:
            for r in per_rank:
                _assert_equal_runs(r[(rate, opt)][False], r[(rate, opt)][True])
