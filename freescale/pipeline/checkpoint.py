"""Training checkpoints: everything a run depends on, written atomically.

A checkpoint taken after step ``n - 1`` is a directory ``step-<n>`` holding

- ``tables/``: the sharded tables and their optimizer state, through
  ``torch.distributed.checkpoint`` (each rank writes its own shard,
  `freescale.embedding.checkpoint`);
- ``trainer.pt`` (rank 0): dense weights, the dense optimizer, the balancer's
  state (cost model, AutoTune) - replicated, so written once;
- ``rank<r>.pt``: that rank's RNG states (python, numpy, torch, CUDA);
- ``manifest.json`` (rank 0, last): the next step, the world size and the
  config; a directory with a manifest is complete.

The data position is the step itself: sources are pure functions of
(step, rank), so the loader restarts at step ``n``.

Atomicity: everything is written into ``step-<n>.partial``; after a barrier
(every rank's files are on disk, fsynced) rank 0 renames it to ``step-<n>``
(an atomic rename) and then drops all but the newest ``keep``. A crash at any
point leaves the previous checkpoint complete and the partial one ignored.
The trainer flushes its schedule first (the `freescale` mode's stash of
prioritized updates), so the tables saved are the ones synchronous training
would have.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from freescale.embedding.checkpoint import load as load_tables
from freescale.embedding.checkpoint import save as save_tables

MANIFEST = "manifest.json"
PREFIX = "step-"
# Config keys that define the model, its tables, the data stream and the
# world: a checkpoint resumes only into a run with the same values. Others
# (steps, lr, mode, balance, logging, ...) may change on resume.
SAME_RUN_KEYS = (
    "nproc", "batch_size", "seed", "data", "num_items", "max_uih", "length_median",
    "length_sigma", "length_cap", "zipf_alpha", "step_overlap", "max_candidates",
    "max_content", "dim", "item_dim", "heads", "layers", "emb_optimizer", "assignment",
    "samples_per_user", "target_stride", "shuffle",
)  # fmt: skip


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """``path`` itself if it is a complete checkpoint, else its newest complete one."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    if not p.is_dir():
        return None
    done = [c for c in p.glob(f"{PREFIX}*") if c.is_dir() and (c / MANIFEST).is_file()]
    return max(done, key=lambda c: read_manifest(c)["step"], default=None)


def read_manifest(path: Path) -> dict[str, Any]:
    return json.loads((path / MANIFEST).read_text())


def check_resumable(resume: str, config: dict[str, Any], world: int) -> Path:
    """The checkpoint a run would resume from; ValueError (one line) if unusable."""
    found = find_checkpoint(resume)
    if found is None:
        raise ValueError(f"resume: no complete checkpoint in {resume!r}")
    manifest = read_manifest(found)
    saved = manifest["config"]
    diff = [k for k in SAME_RUN_KEYS if k in saved and saved[k] != config.get(k)]
    if diff:
        pairs = ", ".join(f"{k}={saved[k]!r} (this run: {config.get(k)!r})" for k in diff)
        raise ValueError(f"resume: {found} was written with {pairs}")
    if manifest["world_size"] != world:
        raise ValueError(
            f"resume: {found} was written by {manifest['world_size']} ranks, not {world}"
        )
    if manifest["step"] >= config["steps"] and not config.get("eval_only"):
        raise ValueError(f"resume: {found} is at step {manifest['step']}; steps={config['steps']}")
    return found


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _write(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Save and restore a trainer's state (all ranks call every method)."""

    def __init__(
        self, directory: str, every: int, keep: int, config: dict[str, Any], group: Any = None
    ) -> None:
        self.directory = Path(directory) if directory else None
        self.every, self.keep, self.config, self.group = every, keep, config, group
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def due(self, step: int) -> bool:
        """Whether a checkpoint is to be written after ``step``."""
        return self.directory is not None and self.every > 0 and (step + 1) % self.every == 0

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def save(self, next_step: int, tables: nn.Module, replicated: dict[str, Any]) -> Path:
        """Write the checkpoint of a run that continues at ``next_step``.

        ``replicated``: objects with ``state_dict()`` that are equal on every
        rank (dense model, optimizer, balancer); rank 0 writes them.
        """
        assert self.directory is not None, "save needs a checkpoint directory"
        final = self.directory / f"{PREFIX}{next_step:08d}"
        partial = final.with_name(final.name + ".partial")
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash mid-save
            partial.mkdir(parents=True)
        self._barrier()
        save_tables(tables, partial / "tables", process_group=self.group)
        _write({"rng": rng_state()}, partial / f"rank{self.rank}.pt")
        if self.rank == 0:
            _write({k: v.state_dict() for k, v in replicated.items()}, partial / "trainer.pt")
        self._barrier()  # every rank's files are on disk
        if self.rank == 0:
            manifest = {"step": next_step, "world_size": self.world, "config": self.config}
            (partial / MANIFEST).write_text(json.dumps(manifest))
            _fsync_dir(partial)
            old = final.with_name(final.name + ".old")
            if final.exists():  # the same step again (e.g. stopped right after a resume)
                final.rename(old)
            partial.rename(final)
            _fsync_dir(self.directory)
            shutil.rmtree(old, ignore_errors=True)
            self._prune()
        self._barrier()
        return final

    def _prune(self) -> None:
        assert self.directory is not None
        done = sorted(
            (c for c in self.directory.glob(f"{PREFIX}*") if (c / MANIFEST).is_file()),
            key=lambda c: read_manifest(c)["step"],
        )
        for c in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(c, ignore_errors=True)

    def load(self, path: Path, tables: nn.Module, replicated: dict[str, Any]) -> int:
        """Restore everything from ``path``; return the step to continue at."""
        manifest = read_manifest(path)
        load_tables(tables, path / "tables", process_group=self.group)
        state = torch.load(path / "trainer.pt", weights_only=False)
        for key, obj in replicated.items():
            if key in state:
                obj.load_state_dict(state[key])
            elif key in ("model", "optimizer"):  # a balancer may be new on resume
                raise ValueError(f"resume: {path} holds no {key} state")
        set_rng_state(torch.load(path / f"rank{self.rank}.pt", weights_only=False)["rng"])
        return int(manifest["step"])
