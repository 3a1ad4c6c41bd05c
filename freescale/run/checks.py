"""Checks of a run's environment, in the launcher, before any rank starts.

Each config section checks its values on their own; this checks what
they point at: files that must exist or be writable, the device an option
needs, the checkpoint a resume starts from. Each failure is one ValueError
sentence (the CLI prints one line and exits 2) instead of a traceback per
rank once training has started.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from freescale.balance import resolve_partitioner
from freescale.config import TrainConfig
from freescale.config.files import config_toml
from freescale.data.source import BUILTIN_KINDS, STREAMS
from freescale.kernels.attention.cudnn_sdpa import package_problem
from freescale.models.contract import load_object
from freescale.observe.board import check_installed
from freescale.pipeline.faults import parse_ranks
from freescale.pipeline.graphs import check_attention
from freescale.run.run_dir import check_run_dir
from freescale.state.checkpoint import check_resumable, find_checkpoint
from freescale.state.run_state import AUTO


def check_launch(cfg: TrainConfig, model_given: bool = False) -> None:
    """Raise ValueError with one sentence for the first thing that would fail later.

    ``model_given``: a model object or factory comes from Python (`freescale.api`):
    the config's factory name is not imported."""
    run = cfg.run
    cuda = run.device == "cuda" or (run.device == "auto" and torch.cuda.is_available())
    attention = cfg.model.options.get("attention", "auto") if cfg.model.builtin else "auto"
    if attention in ("varlen", "cudnn") and not cuda:
        raise ValueError(
            f"model.attention={attention} needs a CUDA device; use model.attention=auto on the CPU"
        )
    cross = cfg.model.options.get("cross_attention", "auto") if cfg.model.builtin else "auto"
    if cross in ("varlen", "triton") and not cuda:
        raise ValueError(
            f"model.cross_attention={cross} needs a CUDA device; use "
            f"model.cross_attention=auto on the CPU"
        )
    if attention == "cudnn":
        # The package here; the GPU's capability on the rank (`check_attention_device`):
        # asking it here would hold a CUDA context in the launcher.
        why = package_problem()
        if why:
            raise ValueError(f"model.attention=cudnn needs {why}")
    if cfg.dense.graphs and not cuda:
        raise ValueError("dense.graphs=true captures CUDA graphs: it needs a CUDA device")
    if cfg.dense.graphs:
        check_attention(attention, cross)
    if cfg.pipeline.sync_debug and not cuda:
        raise ValueError(
            "pipeline.sync_debug=true reports host waits for a GPU: it needs a CUDA device"
        )
    world = int(os.environ.get("WORLD_SIZE", run.nproc))
    for key in ("delay_ranks", "nan_ranks"):
        ranks = parse_ranks(getattr(cfg.faults, key))
        if ranks is not None and max(ranks) >= world:
            text = getattr(cfg.faults, key)
            raise ValueError(f"faults.{key}={text!r} names a rank outside 0..{world - 1}")
    kind, _, path = cfg.data.source.partition(":")
    # (a streamed source takes directories, globs, URLs: it checks them itself, in check_data)
    if kind in BUILTIN_KINDS and kind not in STREAMS and path and not Path(path).is_file():
        hint = f"; point at it with --data {kind}:PATH" if cfg.eval_only else ""
        raise ValueError(f"data file {path!r} ({kind}) does not exist or is not a file{hint}")
    if not cfg.model.builtin and not model_given:
        load_object(cfg.model.factory, "model")  # importable, before any rank starts
    resolve_partitioner(cfg.balance.method, "balance.method")  # user code: importable too
    for key in ("metrics_path", "trace_path"):
        value = getattr(cfg.output, key)
        if value:
            _writable_dir(f"output.{key}", Path(value.replace("{rank}", "0")).parent)
    if cfg.checkpoint.dir:
        _writable_dir("checkpoint.dir", Path(cfg.checkpoint.dir))
    if cfg.output.dir or cfg.checkpoint.dir:  # they hold the config as TOML
        config_toml(cfg)
    if cfg.output.dir:
        _writable_dir("output.dir", Path(cfg.output.dir))
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun rank 0 writes config.toml
            check_run_dir(cfg)
    if cfg.output.tensorboard:
        check_installed()
    resume = cfg.checkpoint.resume
    if resume == AUTO:  # (the ranks decide again, alike, and say which: `RunState`)
        found = find_checkpoint(cfg.checkpoint.dir)
        resume = str(found) if found is not None else ""
    if resume:
        # Spawning ranks here: check every file now (one line, rc 2, before any
        # rank). Under torchrun each process is a rank: they check the files
        # together, sharing the hashing, in `Checkpointer.load`.
        torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
        check_resumable(resume, cfg.as_dict(), verify=not torchrun)


def _writable_dir(key: str, directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{key}: cannot create {str(directory)!r} ({e.strerror})") from None
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ValueError(f"{key}: {str(directory)!r} is not writable")
