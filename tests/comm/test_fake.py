import threading

import pytest
import torch

from freescale.comm import (
    Communicator,
    FakeWorld,
    FakeWorldAborted,
    Work,
    exchange_counts,
    run_threads,
)
from tests.comm._cases import assert_expected, exercise


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_fake_collectives_match_first_principles(world_size):
    assert_expected(run_threads(exercise, world_size))


def test_fake_communicator_implements_the_protocol():
    comm = FakeWorld(1).communicator(0)
    assert isinstance(comm, Communicator)
    assert isinstance(comm.all_gather(torch.zeros(1)), Work)


def test_input_reuse_after_issue_does_not_change_the_result():
    def body(comm):
        x = torch.full((1,), float(comm.rank))
        work = comm.all_gather(x)
        x.fill_(-1.0)
        return work.wait().tolist()

    assert run_threads(body, 2) == [[0.0, 1.0]] * 2


def _mismatched_counts(comm):
    # Rank 0 sends 1 row to rank 1, which expects 2.
    send = [0, 1] if comm.rank == 0 else [0, 0]
    recv = [0, 0] if comm.rank == 0 else [2, 0]
    return comm.all_to_all_v(torch.zeros(sum(send), 2), send, recv).wait()


def test_mismatched_counts_raise_instead_of_hanging():
    with pytest.raises(RuntimeError, match="rank 0 sends 1 rows to rank 1, which expects 2"):
        run_threads(_mismatched_counts, 2, timeout=10)


def _different_ops(comm):
    x = torch.zeros(1)
    if comm.rank == 0:
        return comm.all_gather(x).wait()
    return comm.all_to_all_v(x, [1, 0], [1, 0]).wait()


def test_different_ops_raise():
    with pytest.raises(RuntimeError, match="disagree on op"):
        run_threads(_different_ops, 2, timeout=10)


def _one_rank_fails(comm):
    if comm.rank == 2:
        raise KeyError("boom")
    return comm.all_gather(torch.zeros(1)).wait()


def test_failing_rank_releases_the_others():
    with pytest.raises(KeyError, match="boom"):
        run_threads(_one_rank_fails, 3, timeout=30)


def test_absent_rank_times_out():
    world = FakeWorld(2, timeout=0.3)
    comm = world.communicator(0)
    with pytest.raises(TimeoutError, match=r"ranks \[1\] never joined"):
        comm.all_gather(torch.zeros(1)).wait()


def test_abort_wakes_waiters():
    world = FakeWorld(2, timeout=30)
    work = world.communicator(0).all_gather(torch.zeros(1))
    threading.Timer(0.1, world.abort, args=("test",)).start()
    with pytest.raises(FakeWorldAborted, match="test"):
        work.wait()


def test_bad_calls_raise_before_issuing():
    comm = FakeWorld(2).communicator(0)
    x = torch.zeros(3, 2)
    with pytest.raises(ValueError, match="needs 2 send and recv counts"):
        comm.all_to_all_v(x, [3], [0, 0])
    with pytest.raises(ValueError, match=">= 0"):
        comm.all_to_all_v(x, [4, -1], [0, 0])
    with pytest.raises(ValueError, match="sum to 2 but x has 3 rows"):
        comm.all_to_all_v(x, [1, 1], [0, 0])
    with pytest.raises(ValueError, match=r"must be \[2\] or \[2, K\]"):
        exchange_counts(comm, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="rank 2 outside"):
        FakeWorld(2).communicator(2)
