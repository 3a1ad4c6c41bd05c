"""`TorchCommunicator` over gloo: uneven and zero splits, several dtypes, async handles."""

import pytest
import torch
import torch.distributed as dist

from freescale.comm import Communicator, TorchCommunicator
from freescale.testing import run_ranks
from tests.comm._cases import assert_expected, exercise


def _torch_rank() -> list:
    comm = TorchCommunicator()
    assert isinstance(comm, Communicator)
    assert comm.device == torch.device("cpu")
    assert (comm.rank, comm.world_size) == (dist.get_rank(), dist.get_world_size())
    result = exercise(comm)
    errors = []
    for send in ([1] * (comm.world_size + 1), [-1] * comm.world_size):
        try:
            comm.all_to_all_v(torch.zeros(1), send, [0] * comm.world_size)
        except ValueError as exc:
            errors.append(str(exc))
    # Tensors are returned as lists: the harness's queue cannot carry tensor
    # storage out of a rank process that has exited.
    data = {k: (str(v.dtype), v.float().tolist(), tuple(v.shape)) for k, v in result.items()}
    return [data, errors]


def _from_lists(data: dict) -> dict:
    dtypes = {str(d): d for d in (torch.float32, torch.int64, torch.bfloat16)}
    return {k: torch.tensor(v, dtype=dtypes[d]).reshape(s) for k, (d, v, s) in data.items()}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_gloo_collectives_match_first_principles(world_size):
    per_rank = run_ranks(_torch_rank, world_size, timeout=60)
    assert_expected([_from_lists(data) for data, _ in per_rank])
    for _, errors in per_rank:
        assert len(errors) == 2 and all("counts" in e or "rows" in e for e in errors)


def test_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(ValueError, match="initialized"):
        TorchCommunicator()


def _one_rank_outputs_are_copies() -> list:
    comm = TorchCommunicator()
    x = torch.arange(6.0).reshape(3, 2)
    gathered = comm.all_gather(x)
    moved = comm.all_to_all_v(x, [3], [3])
    x.add_(100.0)  # the caller may reuse its buffer once the call is issued
    return [gathered.wait().tolist(), moved.wait(None).tolist()]


def test_one_rank_collectives_are_local_copies():
    """World size 1 skips the process group (no NCCL call) but keeps the contract:
    a new output with the input's values at issue time."""
    gathered, moved = run_ranks(_one_rank_outputs_are_copies, 1, timeout=60)[0]
    assert gathered == moved == torch.arange(6.0).reshape(3, 2).tolist()
