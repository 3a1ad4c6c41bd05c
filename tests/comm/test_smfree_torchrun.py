"""Two hosts without a second host: two torchrun launchers on 127.0.0.1 (2 nodes x 2 ranks).

One c10d rendezvous, ``--local-addr 127.0.0.1`` and ``GLOO_SOCKET_IFNAME=lo``:
nothing leaves the loopback interface. The launchers run in their own
process groups and are killed (by their ids) if they outlive the time limit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from freescale.comm.nixl_support import nixl_installed
from freescale.testing.multirank import free_port

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 150
NIXL = nixl_installed()


def _launch_two_nodes(*script: str) -> list[str]:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
    }
    procs = []
    try:
        for node in (0, 1):
            cmd = [
                sys.executable, "-m", "torch.distributed.run",
                "--nnodes", "2", "--nproc-per-node", "2", "--node-rank", str(node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", f"smfree-{port}", "--local-addr", "127.0.0.1",
                "--rdzv-conf", f"is_host={'true' if node == 0 else 'false'}",
                *script,
            ]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        outputs = [p.communicate(timeout=LIMIT_S)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)  # the launcher and its ranks
                p.wait(timeout=10)
    for p, out in zip(procs, outputs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outputs


def test_torchrun_two_nodes_detects_hosts_and_matches_torch(tmp_path):
    _launch_two_nodes("tests/comm/_torchrun_check.py", str(tmp_path))
    results = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    assert sorted(r["node"] for r in results) == [0, 0, 1, 1]
    for r in results:
        assert r["transport"] == ("hier-nixl" if NIXL else "hier"), r
        assert r["hierarchical_gather"], r
        assert r["shm_peers"] == r["same_node"] and len(r["same_node"]) == 2, r
        assert r["diff"] == [] and r["keys"] == 16, r
        if NIXL:
            nixl = r["nixl"]
            assert nixl["transport"] == "nixl" and nixl["diff"] == [] and nixl["keys"] == 16, r


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "sdd", "freescale"])
def test_torchrun_two_nodes_training_matches_torch(mode, tmp_path):
    losses = {}
    for backend in ("torch", "smfree", *(("smfree-nixl",) if NIXL else ())):
        metrics = tmp_path / f"{backend}.jsonl"
        outputs = _launch_two_nodes(
            "-m", "freescale.cli.main", "train", "--mode", mode,
            "--set", "run.steps=5", "--set", "run.warmup=1", "--set", "evaluation.every=0",
            "--set", "output.progress=false", "--set", f"pipeline.comm_backend={backend}",
            "--set", f"output.metrics_path={metrics}",
        )  # fmt: skip
        # Rank 0's summary, from whichever launcher the rendezvous gave rank 0.
        summary = next(json.loads(s) for s in "".join(outputs).splitlines() if '"world_size"' in s)
        assert summary["world_size"] == 4
        ran = summary["comm"]["comm_backend"].get("transport")
        assert ran == {"torch": None, "smfree": "hier-nixl" if NIXL else "hier"}.get(backend, ran)
        losses[backend] = [json.loads(s)["loss"] for s in metrics.read_text().splitlines()]
    assert len(losses["torch"]) == 5
    for backend in losses:
        assert losses["torch"] == losses[backend], backend
