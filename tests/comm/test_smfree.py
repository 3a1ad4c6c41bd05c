"""The smfree backend over gloo CPU ranks: bit-identical to the torch backend on every transport.

Each case runs the shared first-principles cases and large uneven multi-dtype
collectives (several in flight, larger than the pool) through smfree and
`TorchCommunicator` on the same ranks and compares them with `torch.equal`.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

from freescale.comm import (
    BACKENDS,
    Communicator,
    PeerError,
    SmFreeCommunicator,
    Work,
    make_communicator,
)
from freescale.comm.nixl_support import INSTALL_HINT, nixl_installed
from freescale.comm.shm_transport import SHM_DIR
from freescale.comm.topology import host_key
from freescale.testing import run_ranks
from tests.comm._cases import assert_expected, exercise
from tests.comm._smfree_cases import compare

CASES = [
    *(("smfree-shm", w, None) for w in (1, 2, 4, 8)),
    *(("smfree-gloo", w, None) for w in (1, 2, 4, 8)),
    ("smfree", 2, None),  # auto: one host -> shm
    ("smfree-hier", 4, 2),  # 2 emulated hosts x 2 ranks: hierarchical AllGather
    ("smfree-hier", 2, 1),  # 2 hosts x 1 rank: the ring alone
    ("smfree-hier", 6, 2),  # 3 hosts x 2 ranks
    ("smfree-hier", 3, 2),  # hosts of 2 and 1 ranks: routed pairwise AllGather
    ("smfree", 4, 2),  # auto: several hosts -> hier-nixl (hier without NIXL)
    *(("smfree-nixl", w, None) for w in (2, 3)),
    *(pytest.param("smfree-nixl", w, None, marks=pytest.mark.slow) for w in (1, 4)),
    pytest.param("smfree-nixl", 4, 2, marks=pytest.mark.slow),  # forced across emulated hosts
]
NIXL = nixl_installed()


@pytest.mark.parametrize(("backend", "world_size", "ranks_per_host"), CASES)
def test_smfree_equals_torch_backend(backend, world_size, ranks_per_host):
    if "nixl" in backend and not NIXL:
        pytest.skip(f"NIXL is not installed ({INSTALL_HINT})")
    per_rank = run_ranks(compare, world_size, backend, ranks_per_host, timeout=120)
    for info in per_rank:
        assert info["diff"] == [], info
        assert info["keys"] == 16
        auto = "shm" if ranks_per_host is None else ("hier-nixl" if NIXL else "hier")
        assert info["transport"] == (auto if backend == "smfree" else backend[len("smfree-") :])
        if world_size > 1:
            assert info["largest"] > 4 * info["chunk"], "the large cases must span several chunks"


def _first_principles(backend: str) -> list[str]:
    comm = make_communicator(backend, "cpu")
    assert isinstance(comm, Communicator)
    got = exercise(comm)
    comm.close()
    return [{k: (str(v.dtype), v.float().tolist(), tuple(v.shape)) for k, v in got.items()}]


TRANSPORT_BACKENDS = [
    "smfree-shm",
    "smfree-gloo",
    pytest.param(
        "smfree-nixl", marks=pytest.mark.skipif(not NIXL, reason=f"no NIXL ({INSTALL_HINT})")
    ),
]


@pytest.mark.parametrize("backend", TRANSPORT_BACKENDS)
def test_smfree_matches_first_principles(backend):
    from tests.comm.test_torch_backend import _from_lists

    per_rank = run_ranks(_first_principles, 3, backend, timeout=60)
    assert_expected([_from_lists(data) for (data,) in per_rank])


def _issue_is_asynchronous(backend: str) -> dict:
    comm = make_communicator(backend, "cpu")
    x = torch.full((1 << 18,), float(comm.rank))  # 1 MiB
    if comm.rank == 1:
        time.sleep(1.0)  # rank 0 issues long before rank 1 joins
    t0 = time.perf_counter()
    works = [comm.all_gather(x), comm.all_to_all_v(x, [x.numel() // 2] * 2, [x.numel() // 2] * 2)]
    issue_s = time.perf_counter() - t0
    assert all(isinstance(w, Work) for w in works)
    outs = [w.wait() for w in works]
    total_s = time.perf_counter() - t0
    ok = torch.equal(outs[0], torch.cat([torch.zeros_like(x), torch.ones_like(x)]))
    comm.close()
    return {"issue_s": issue_s, "total_s": total_s, "ok": ok}


@pytest.mark.parametrize("backend", TRANSPORT_BACKENDS)
def test_issuing_returns_at_once(backend):
    r0, _ = run_ranks(_issue_is_asynchronous, 2, backend, timeout=60)
    assert r0["ok"]
    assert r0["issue_s"] < 0.1, r0  # two collectives issued while the peer is asleep
    assert r0["total_s"] > 0.8, r0  # ...and completed only once it joined


def _peer_fails(backend: str, how: str, timeout: float, marker: str) -> dict:
    comm = make_communicator(backend, "cpu", timeout=timeout)
    victim = comm.world_size - 1
    comm.all_gather(torch.zeros(4)).wait()  # everyone is connected and healthy
    if comm.rank == victim:
        if how == "exit":
            time.sleep(0.3)
            os._exit(3)
        time.sleep(timeout + 3.0)
        return {"victim": True}
    t0 = time.perf_counter()
    try:
        comm.all_to_all_v(torch.zeros(comm.world_size, 2), [1] * 3, [1] * 3).wait()
        result = {"error": None}
    except PeerError as exc:
        result = {"error": str(exc), "peer": exc.peer, "elapsed": time.perf_counter() - t0}
        t1 = time.perf_counter()
        try:  # the communicator is broken from now on: fails at once, no hang
            comm.all_gather(torch.zeros(1)).wait()
        except PeerError:
            result["again_s"] = time.perf_counter() - t1
    with open(f"{marker}.{comm.rank}", "w") as f:
        f.write(repr(result))
    comm.close()
    return result


@pytest.mark.parametrize("backend", TRANSPORT_BACKENDS)
@pytest.mark.parametrize("how", ["stall", "exit"])
def test_dead_or_stalled_peer_is_named_within_the_timeout(backend, how, tmp_path):
    timeout, marker = 3.0, str(tmp_path / "result")
    if how == "stall":
        run_ranks(_peer_fails, 3, backend, how, timeout, marker, timeout=60)
    else:
        with pytest.raises(Exception, match="rank 2 exited"):
            run_ranks(_peer_fails, 3, backend, how, timeout, marker, timeout=60)
    for rank in (0, 1):
        with open(f"{marker}.{rank}") as f:
            result = eval(f.read())
        assert result["error"] is not None, result
        assert result["peer"] == 2 and "peer rank 2" in result["error"], result
        assert result["elapsed"] < timeout + 2.0, result
        assert result["again_s"] < 0.5, result


def _segments_are_freed() -> dict:
    before = set(os.listdir(SHM_DIR))
    comm = make_communicator("smfree-shm", "cpu", pool_bytes=1 << 20)
    comm.all_gather(torch.zeros(3)).wait()  # every peer has mapped every segment
    # Each creator unlinks its segment once the peers confirmed their mapping;
    # a peer's unlink may trail this rank's return by a moment (seen under load).
    deadline = time.monotonic() + 5.0
    while True:
        during = {f for f in set(os.listdir(SHM_DIR)) - before if "freescale" in f}
        if not during or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    thread = comm._worker.thread
    comm.close()
    comm.close()  # idempotent
    try:
        comm.all_gather(torch.zeros(3))
        reused = True
    except RuntimeError:
        reused = False
    return {"during": sorted(during), "alive": thread.is_alive(), "reused": reused}


def test_close_stops_the_thread_and_leaves_no_segment():
    for info in run_ranks(_segments_are_freed, 2, timeout=60):
        # Segments are unlinked as soon as every peer mapped them.
        assert info == {"during": [], "alive": False, "reused": False}


def _hosts_detected(ranks_per_host: int) -> dict:
    comm = make_communicator("smfree", "cpu", ranks_per_host=ranks_per_host)
    out = {"transport": comm.transport.name, "local": sorted(comm.transport.shm.local)}
    comm.close()
    return out


def test_emulated_hosts_use_shm_inside_and_nixl_or_gloo_between():
    per_rank = run_ranks(_hosts_detected, 4, 2, timeout=60)
    assert [i["local"] for i in per_rank] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert {i["transport"] for i in per_rank} == {"hier-nixl" if NIXL else "hier"}


def test_host_key_sources():
    torchrun = {"GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    assert host_key(3, None, torchrun) == (1, "torchrun")
    assert host_key(3, 2, torchrun) == (1, "ranks_per_host")  # the override wins
    assert host_key(5, 4, {}) == (1, "ranks_per_host")
    assert host_key(5, None, {"LOCAL_RANK": "5"}) == (0, "assumed single host")
    with pytest.raises(ValueError, match="ranks_per_host"):
        host_key(0, 0, {})


def test_bad_choices_raise_one_line_naming_the_alternatives():
    for name in ("nccl", "smfree-rdma", "smfree-"):
        with pytest.raises(ValueError) as info:
            make_communicator(name, "cpu")
        assert "\n" not in str(info.value) and all(b in str(info.value) for b in BACKENDS)
    assert "smfree-nixl" in BACKENDS


def _shm_across_hosts() -> str:
    try:
        make_communicator("smfree-shm", "cpu", ranks_per_host=1)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_shm_refuses_several_hosts():
    for msg in run_ranks(_shm_across_hosts, 2, timeout=60):
        assert "needs one host, found 2" in msg and "smfree-hier" in msg


def test_needs_an_initialized_group():
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(ValueError, match="initialized"):
        SmFreeCommunicator(None, None)  # type: ignore[arg-type]
