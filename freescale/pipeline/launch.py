"""Start the ranks of a training run: under ``torchrun``, or spawned by us.

Under ``torchrun`` (RANK/WORLD_SIZE in the environment) this process is one
rank. Otherwise ``cfg.nproc`` processes are spawned on this host (gloo on the
CPU, NCCL with one GPU each). A rank that raises ends the run with its
traceback; a collective that hangs ends it at the process-group timeout.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from freescale.pipeline.config import TrainConfig
from freescale.pipeline.train import run_rank

PG_TIMEOUT = timedelta(minutes=10)


def _backend(cfg: TrainConfig) -> str:
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(cfg: TrainConfig) -> dict[str, Any] | None:
    """Run training; return rank 0's summary (None on other torchrun ranks)."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but no CUDA device is visible")
    if under_torchrun():
        return _run_initialized(cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    if _backend(cfg) == "nccl" and cfg.nproc > torch.cuda.device_count():
        raise ValueError(f"nproc={cfg.nproc} but only {torch.cuda.device_count()} GPUs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(
        _spawned, args=(cfg, port, results), nprocs=cfg.nproc, join=True, start_method="spawn"
    )
    return results.get() if not results.empty() else None


def _spawned(rank: int, cfg: TrainConfig, port: int, results: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(cfg.nproc),
        LOCAL_RANK=str(rank),
    )
    if _backend(cfg) == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // cfg.nproc))
    summary = _run_initialized(cfg, rank, cfg.nproc)
    if rank == 0:
        results.put(summary)


def _run_initialized(cfg: TrainConfig, rank: int, world: int) -> dict[str, Any] | None:
    backend = _backend(cfg)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=PG_TIMEOUT)
    try:
        return run_rank(cfg)
    finally:
        dist.destroy_process_group()
