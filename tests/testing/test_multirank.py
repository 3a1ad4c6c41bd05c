import os
import time

import pytest
import torch
import torch.distributed as dist

from freescale.testing import RankError, RankTimeout, run_ranks


def _allreduce_rank() -> int:
    t = torch.tensor([dist.get_rank() + 1])
    dist.all_reduce(t)
    return int(t)


def _raise_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise KeyError("boom on purpose")
    dist.barrier()  # the healthy ranks block here until killed
    return 0


def _hang_on_last_rank() -> int:
    if dist.get_rank() == dist.get_world_size() - 1:
        time.sleep(600)
    return dist.get_rank()


def _exit_hard() -> None:
    if dist.get_rank() == 0:
        os._exit(3)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_collectives_work_at_each_world_size(world_size):
    expected = world_size * (world_size + 1) // 2
    assert run_ranks(_allreduce_rank, world_size) == [expected] * world_size


def test_raising_rank_fails_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1 of 2 raised:[\s\S]*KeyError: 'boom on purpose'"):
        run_ranks(_raise_on_rank_one, 2, timeout=60)
    assert time.monotonic() - start < 30, "the failure must not wait for the timeout"


def test_hanging_rank_fails_by_timeout():
    start = time.monotonic()
    with pytest.raises(RankTimeout, match=r"ranks \[2\] did not finish"):
        run_ranks(_hang_on_last_rank, 3, timeout=5)
    assert time.monotonic() - start < 20


def test_crashing_rank_is_reported():
    with pytest.raises(RankError, match="rank 0 exited with code 3"):
        run_ranks(_exit_hard, 2, timeout=30)


def _exit_hard_then_peer_raises() -> None:
    # Both past the process group's setup first: a crash during the peer's
    # connect shows as its "Connection reset" there (seen once under load).
    dist.barrier()
    if dist.get_rank() == 0:
        os._exit(3)
    time.sleep(0.5)  # the crash is reaped before this rank reports
    raise ConnectionResetError("lost my peer")


def test_crash_is_named_before_the_error_it_caused():
    # A peer's error that follows a crash (e.g. its store connection reset)
    # must not hide the crash.
    with pytest.raises(RankError, match=r"rank 0 exited with code 3[\s\S]*lost my peer"):
        run_ranks(_exit_hard_then_peer_raises, 2, timeout=30)


def test_rejects_bad_world_size():
    with pytest.raises(ValueError):
        run_ranks(_allreduce_rank, 0)


def _return_tensors() -> dict:
    return {"rank": dist.get_rank(), "t": torch.arange(5) * (dist.get_rank() + 1)}


def test_ranks_can_return_tensors():
    out = run_ranks(_return_tensors, 2)
    assert torch.equal(out[1]["t"], torch.arange(5) * 2) and out[0]["rank"] == 0


def _threads_rank() -> int:
    return torch.get_num_threads()


@pytest.mark.numeric  # under scripts/numeric_matrix.sh: the leg's count is really used
def test_ranks_take_their_thread_count_from_the_environment(monkeypatch):
    from freescale.testing.multirank import THREADS_ENV, rank_threads

    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert rank_threads() == 1
    monkeypatch.setenv(THREADS_ENV, "3")
    assert rank_threads() == 3
    for bad in ("0", "two"):
        monkeypatch.setenv(THREADS_ENV, bad)
        with pytest.raises(ValueError, match=THREADS_ENV):
            rank_threads()
    # The ranks (forked from a server started with this process's environment)
    # run with what it said when the server started.
    monkeypatch.undo()
    assert run_ranks(_threads_rank, 1) == [rank_threads()]
    if os.environ.get(THREADS_ENV):  # tests/conftest.py gave it to this process too
        assert torch.get_num_threads() == rank_threads()
