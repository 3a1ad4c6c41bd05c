"""The global RNG states go through a checkpoint and come back: a load that read
them but did not restore them would go unnoticed elsewhere (training draws
from no global generator), so this checks the round trip itself, in one
process, in about a second."""

import random

import numpy as np
import pytest
import torch
from torch import nn

from freescale.state.checkpoint import Checkpointer
from freescale.state.position import DataPosition


def _draws() -> list:
    out = [random.random(), random.gauss(0, 1), np.random.rand(), np.random.randn()]
    out.append(torch.rand(3).tolist())
    if torch.cuda.is_available():
        out.append(torch.rand(3, device="cuda").tolist())
    return out


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_rng_states_round_trip_through_save_and_load(tmp_path):
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)  # CUDA too, when present (and initialized by the draws)
    _draws()
    random.gauss(0, 1)  # leave a cached gaussian in python's and numpy's states
    np.random.randn()
    tables, dense = nn.Embedding(5, 2), nn.Linear(2, 1)
    replicated = {"model": dense, "optimizer": torch.optim.SGD(dense.parameters(), lr=0.1)}
    checkpoints = Checkpointer(str(tmp_path), every=1, keep=1, config={})
    path = checkpoints.save(3, tables, replicated, samples_seen=48)
    expected = _draws()  # what a run continuing from the save draws
    for _ in range(3):
        _draws()  # the generators move on (a later step, or a new process)
    torch.manual_seed(123)
    assert checkpoints.load(path, tables, replicated) == DataPosition(3, 48, 1)
    assert _draws() == expected
