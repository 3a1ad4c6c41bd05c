"""The NIXL transport: staging selection, the message without NIXL, and a peer killed mid-exchange.

Bit-identity with the torch backend is checked with the other transports
(`test_smfree.py`, `test_smfree_train.py`, `test_smfree_torchrun.py`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from freescale.comm import PeerError, make_communicator
from freescale.comm import factory as comm_factory
from freescale.comm.nixl_support import (
    INSTALL_HINT,
    nixl_installed,
    pick_staging,
    ucx_excludes_cuda,
)
from freescale.comm.shm_transport import SHM_DIR
from freescale.config import build_config
from freescale.config import sections as config_sections
from freescale.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]
needs_nixl = pytest.mark.skipif(not nixl_installed(), reason=f"no NIXL ({INSTALL_HINT})")
CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


def _probe(ok: bool, calls: list[int]):
    def probe() -> tuple[bool, str]:
        calls.append(1)
        return ok, "probe says so"

    return probe


def test_staging_selection():
    calls: list[int] = []
    # CPU tensors: always host staging; the GPU probe is never asked.
    assert pick_staging("auto", CPU, _probe(True, calls))[0] == "host"
    assert pick_staging("host", CPU, _probe(True, calls))[0] == "host"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        pick_staging("device", CPU, _probe(True, calls))
    assert calls == []
    # A GPU: auto follows the probe, host never asks it, device insists.
    assert pick_staging("auto", GPU, _probe(True, calls))[0] == "device"
    mode, why = pick_staging("auto", GPU, _probe(False, calls))
    assert mode == "host" and "probe says so" in why
    assert pick_staging("host", GPU, _probe(True, calls))[0] == "host"
    assert pick_staging("device", GPU, _probe(True, calls))[0] == "device"
    with pytest.raises(ValueError, match="not available here: probe says so"):
        pick_staging("device", GPU, _probe(False, calls))
    assert len(calls) == 4
    with pytest.raises(ValueError, match="host, device, auto"):
        pick_staging("gpu", CPU, _probe(True, calls))


def test_ucx_tls_without_cuda_rules_out_the_device_path():
    assert ucx_excludes_cuda({"UCX_TLS": "tcp,self,sm"})
    assert not ucx_excludes_cuda({"UCX_TLS": "rc,cuda_copy,cuda_ipc"})
    assert not ucx_excludes_cuda({"UCX_TLS": "^tcp"})  # exclusions keep the rest
    assert not ucx_excludes_cuda({})


def test_config_keys():
    cfg = build_config("demo")
    assert (cfg.pipeline.comm_staging, cfg.pipeline.comm_nixl_backend) == ("auto", "UCX")
    with pytest.raises(ValueError, match="comm_staging must be one of host, device, auto"):
        build_config("demo", ["pipeline.comm_staging=gpu"])
    with pytest.raises(ValueError, match="comm_nixl_backend must be one of UCX, LIBFABRIC"):
        build_config("demo", ["pipeline.comm_nixl_backend=verbs"])


def test_without_nixl_naming_it_is_one_line_saying_what_to_install(monkeypatch):
    monkeypatch.setattr(config_sections, "nixl_installed", lambda: False)
    monkeypatch.setattr(comm_factory, "nixl_installed", lambda: False)
    for key in ("comm_backend", "comm_overlapped"):
        with pytest.raises(ValueError) as info:
            build_config("demo", [f"pipeline.{key}=smfree-nixl"])
        assert "\n" not in str(info.value) and INSTALL_HINT in str(info.value)
    with pytest.raises(ValueError, match=r"smfree-nixl needs NIXL.*freescale\[rdma\]"):
        make_communicator("smfree-nixl", "cpu")


HIDE_NIXL = """
import importlib.util, sys
real = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.startswith("nixl") else real(name, *a)
from freescale.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_cli_without_nixl_exits_2_with_one_line():
    cmd = [sys.executable, "-c", HIDE_NIXL, "train", "--set", "pipeline.comm_backend=smfree-nixl"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2, run.stderr[-2000:]
    assert lines == [
        "freescale: error: pipeline.comm_backend=smfree-nixl needs NIXL, which is not"
        f" installed: {INSTALL_HINT}"
    ]


def _auto_without_nixl() -> dict:
    comm_factory.nixl_installed = lambda: False  # this rank process only
    comm = make_communicator("smfree", "cpu", ranks_per_host=1)
    out = {"transport": comm.transport.name, "why": comm.why}
    comm.close()
    return out


def test_smfree_across_hosts_without_nixl_says_why():
    for info in run_ranks(_auto_without_nixl, 2, timeout=60):
        assert info["transport"] == "hier"
        assert "NIXL is not installed" in info["why"] and INSTALL_HINT in info["why"]


def _auto_with_nixl() -> dict:
    comm = make_communicator("smfree", "cpu", ranks_per_host=1)
    out = {"transport": comm.transport.name, "why": comm.why, "chunk": comm.transport.chunk_bytes}
    x = torch.arange(10, dtype=torch.int64) + 100 * comm.rank
    out["gathered"] = comm.all_gather(x).wait().tolist()
    comm.close()
    return out


@needs_nixl
def test_smfree_across_hosts_picks_nixl():
    for info in run_ranks(_auto_with_nixl, 2, timeout=60):
        assert info["transport"] == "hier-nixl", info
        assert "NIXL between hosts" in info["why"]
        assert info["gathered"] == list(range(10)) + list(range(100, 110))


def _killed_mid_exchange(timeout: float, marker: str) -> dict:
    comm = make_communicator("smfree-nixl", "cpu", timeout=timeout, pool_bytes=64 << 10)
    victim, w = comm.world_size - 1, comm.world_size
    comm.all_gather(torch.zeros(4)).wait()  # connected and healthy
    rows = 1 << 20  # 4 MiB per peer: hundreds of chunks
    x = torch.ones(w * rows)
    if comm.rank == victim:
        # SIGKILL from a thread while the helper thread is inside the exchange.
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        comm.all_to_all_v(x, [rows] * w, [rows] * w).wait()
        time.sleep(60)
    t0 = time.perf_counter()
    result: dict = {"error": None}
    try:
        comm.all_to_all_v(x, [rows] * w, [rows] * w).wait()
    except PeerError as exc:
        result = {"error": str(exc), "peer": exc.peer, "elapsed": time.perf_counter() - t0}
    transport = comm.transport
    comm.close()
    result.update(closed=transport.closed, registered=transport._registered is not None)
    Path(f"{marker}.{comm.rank}").write_text(repr(result))
    return result


@needs_nixl
def test_peer_killed_mid_exchange_is_named_and_nothing_is_left(tmp_path):
    timeout, marker = 3.0, str(tmp_path / "result")
    shm_before = set(os.listdir(SHM_DIR))
    with pytest.raises(Exception, match="rank 2 exited"):
        run_ranks(_killed_mid_exchange, 3, timeout, marker, timeout=60)
    for rank in (0, 1):
        result = eval(Path(f"{marker}.{rank}").read_text())
        assert result["peer"] == 2 and result["error"].startswith("peer rank 2: "), result
        assert "\n" not in result["error"], result
        assert result["elapsed"] < timeout + 2.0, result
        assert result["closed"] and not result["registered"], result
        print(f"rank {rank}, {result['elapsed']:.2f} s: {result['error']}")
    # No segment of ours or UCX's (other jobs on the machine may create files meanwhile).
    new = set(os.listdir(SHM_DIR)) - shm_before
    left = {f for f in new if any(k in f.lower() for k in ("ucx", "nixl", "freescale"))}
    assert left == set()
