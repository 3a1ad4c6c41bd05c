"""Training checkpoints: everything a run depends on, written atomically.

A checkpoint taken after step ``n - 1`` is a directory ``step-<n>`` holding

- ``tables/``: the sharded tables and their optimizer state, through
  ``torch.distributed.checkpoint`` as `freescale.embedding.TableEntries`:
  each table a ``DTensor`` of contiguous row chunks, each rank writing its
  chunk, so any world size can read them (DCP reshards); a dynamic table's
  rows by id with its map (`freescale.embedding.state.dynamic_entries`);
- ``trainer.pt`` (rank 0): dense weights, the dense optimizer, the balancer's
  state (cost model, AutoTune), with ``evaluation.keep_best`` the best
  evaluation (`freescale.state.best`: metric, value, step, evaluations
  since, its dense weights) - replicated, so written once;
- ``best/`` (with a best): the best evaluation's table rows, as ``tables/``
  (`WeightCopies`; no optimizer state);
- ``rank<r>.pt``: that rank's RNG states (python, numpy, torch, CUDA) as
  tensors (`freescale.state.rng`);
- ``config.toml`` (rank 0): the run's config (`freescale.config.files`);
- ``manifest.json`` (rank 0, last): the format, the next step, the world
  size, the samples consumed before the next step, the run's segments
  (``[[first step, world size], ...]``; optional, older manifests have one),
  the config (the values of ``config.toml``; older checkpoints have no such
  file), and ``[bytes, sha256]`` of every other file; a directory with a
  manifest is complete.

Nothing in it runs code on load and nothing damaged is used
(`freescale.state.checkpoint_files`): ``.pt`` files load with
``weights_only=True``, the tables through `freescale.embedding.state.dcp_safe`, and
every file's size and SHA-256 are checked against the manifest first. The
ranks split the hashing by bytes, at save and at load; at load they agree on
the first problem found (`freescale.comm.rank_text`), so every rank
raises the same one-line ValueError before any state changes.

Another world size. A checkpoint written by W ranks resumes at any W': the
tables, their optimizer state and the best rows reshard exactly; dense
weights, Adam and the balancer's cost model are replicated and load as they
are (AutoTune's per-rank shares start afresh at another W); rank ``r``
restores the RNG states of saved rank ``r``, or of saved rank 0 where
``r >= W`` (every rank is seeded alike and training draws from no global
generator, so they are equal unless a model draws rank-dependently). The
data position: the run continues at step ``n``, a source that can continues
at the sample it stopped at, one stream per rank (``parquet-stream``)
redeals the rest of its epochs to the new ranks
(`freescale.state.position`).

Atomicity: everything is written into ``step-<n>.partial``; after a barrier
(every rank's files are on disk, fsynced) rank 0 renames it to ``step-<n>``
(an atomic rename) and then drops all but the newest ``keep``. A crash at any
point leaves the previous checkpoint complete and the partial one ignored.
The trainer flushes its schedule first (the `freescale` mode's stash of
prioritized updates), so the tables saved are the ones synchronous training
would have.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tomllib
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from freescale.comm.rank_text import all_gather_text, broadcast_text, first_problem
from freescale.config.files import toml_text
from freescale.embedding.state.checkpoint import load as load_tables
from freescale.embedding.state.checkpoint import save as save_tables
from freescale.state.checkpoint_files import (
    BEST,
    FORMAT,
    MANIFEST,
    TABLES,
    check_manifest,
    list_files,
    read_checked,
    sha256_file,
    share,
    write_plain,
)
from freescale.state.position import DataPosition, Segments
from freescale.state.rng import rng_state, set_rng_state

PREFIX = "step-"
CONFIG = "config.toml"  # the config as TOML: `freescale train --config` reads it
# Config keys that define the model, its tables and the data stream: a
# checkpoint resumes only into a run with the same values. Others (steps, lr,
# mode, balance, logging, the world size, ...) may change on resume.
SAME_RUN_KEYS = (
    "run.batch_size", "run.seed", "data.source", "data.num_items", "data.max_uih",
    "data.length_median", "data.length_sigma", "data.length_cap", "data.zipf_alpha",
    "data.step_overlap", "data.max_candidates", "data.max_content", "data.samples_per_user",
    "data.target_stride", "data.shuffle", "data.options", "model.factory", "model.options",
    "embeddings.optimizer", "embeddings.assignment",
)  # fmt: skip


def flat_config(config: dict[str, Any]) -> dict[str, Any]:
    """``{"section.key": value}`` of a config dict, nested or (old manifests) flat."""
    from freescale.config import BUILTIN_MODEL, TrainConfig
    from freescale.models.sequence import with_defaults

    nested = TrainConfig.from_dict(config).as_dict()
    if nested["model"]["factory"] == BUILTIN_MODEL:  # its defaults, spelled out or not
        nested["model"]["options"] = with_defaults(nested["model"]["options"])
    return {
        f"{section}.{key}": value
        for section, values in nested.items()
        if isinstance(values, dict)
        for key, value in values.items()
    }


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """``path`` itself if it is a complete checkpoint, else its newest complete one."""
    p = Path(path)
    if (p / MANIFEST).is_file():
        return p
    if not p.is_dir():
        return None
    done = [c for c in p.glob(f"{PREFIX}*") if c.is_dir() and (c / MANIFEST).is_file()]
    return max(done, key=_step, default=None)


def _step(checkpoint: Path) -> int:
    """The step in ``checkpoint``'s manifest, of any format (ValueError if unreadable)."""
    file = checkpoint / MANIFEST
    try:
        step = json.loads(file.read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint file {file} cannot be read ({e})") from None
    if not isinstance(step, int):
        raise ValueError(f"checkpoint file {file} is malformed (step {step!r})")
    return step


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of the checkpoint ``path``, checked for form (ValueError, one line)."""
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"checkpoint file {file} cannot be read ({e})") from None
    check_manifest(manifest, file)
    return manifest


def check_resumable(resume: str, config: dict[str, Any], verify: bool = True) -> Path:
    """The checkpoint a run would resume from; ValueError (one line) if unusable.

    ``verify``: also check every file (sizes, SHA-256, plain content; seconds
    per 10 GB). The launcher does; the ranks check again, sharing the work,
    in `Checkpointer.load`. An evaluation (``eval_only``) may read its data
    from another path (`freescale eval --data`, its schema checked there).
    """
    evaluating = bool(config.get("eval_only"))
    command = "eval" if evaluating else "resume"
    found = find_checkpoint(resume)
    if found is None:
        raise ValueError(f"{command}: no complete checkpoint in {resume!r}")
    manifest = read_manifest(found)
    saved, this = flat_config(manifest["config"]), flat_config(config)
    keys = [k for k in SAME_RUN_KEYS if not (evaluating and k == "data.source")]
    diff = [k for k in keys if saved[k] != this[k]]
    if diff:
        pairs = ", ".join(f"{k}={saved[k]!r} (this run: {this[k]!r})" for k in diff)
        raise ValueError(f"{command}: {found} was written with {pairs}")
    steps = this["run.steps"]
    if manifest["step"] >= steps and not evaluating:
        raise ValueError(f"resume: {found} is at step {manifest['step']}; run.steps={steps}")
    if verify:
        read_checked(found, manifest, range(manifest["world_size"]), manifest["files"])
    return found


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Checkpointer:
    """Save and restore a trainer's state (all ranks call every method)."""

    def __init__(
        self,
        directory: str,
        every: int,
        keep: int,
        config: dict[str, Any],
        group: Any = None,
        data: Any = None,
    ) -> None:
        """``data``: the run's `freescale.state.data_record.DataRecord` (None: no record)."""
        self.directory = Path(directory) if directory else None
        self.every, self.keep, self.config, self.group = every, keep, config, group
        self.data = data
        values = {k: v for k, v in config.items() if k != "eval_only"}  # no key: a command's
        self.config_text = toml_text(values) if self.directory else ""
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def due(self, step: int) -> bool:
        """Whether a checkpoint is to be written after ``step``."""
        return self.directory is not None and self.every > 0 and (step + 1) % self.every == 0

    def _barrier(self) -> None:
        if self.world > 1:
            dist.barrier(group=self.group)

    def save(
        self,
        next_step: int,
        tables: nn.Module,
        replicated: dict[str, Any],
        samples_seen: int,
        segments: Segments = (),
        best: nn.Module | None = None,
    ) -> Path:
        """Write the checkpoint of a run that continues at ``next_step``.

        ``tables``: a module whose ``state_dict()`` DCP saves (the trainer's:
        `TableEntries`). ``replicated``: objects with ``state_dict()`` that are
        equal on every rank (dense model, optimizer, balancer); rank 0 writes
        them. ``samples_seen``: samples consumed before ``next_step``, all ranks.
        ``segments``: the run's world sizes by step (`freescale.state.position`;
        ``()``: this world size throughout). ``best``: the best evaluation's
        rows (`BestWeights.tables`), saved as ``tables`` is.
        """
        assert self.directory is not None, "save needs a checkpoint directory"
        final = self.directory / f"{PREFIX}{next_step:08d}"
        partial = final.with_name(final.name + ".partial")
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by a crash mid-save
            partial.mkdir(parents=True)
        self._barrier()
        save_tables(tables, partial / TABLES, process_group=self.group)
        if best is not None:
            save_tables(best, partial / BEST, process_group=self.group)
        write_plain({"rng": rng_state()}, partial / f"rank{self.rank}.pt")
        data = None
        if self.rank == 0:
            write_plain({k: v.state_dict() for k, v in replicated.items()}, partial / "trainer.pt")
            (partial / CONFIG).write_text(self.config_text)
            if self.data is not None:
                data = self.data.write(partial)
        self._barrier()  # every rank's files are on disk
        files = self._digests(partial)
        if self.rank == 0:
            manifest = {
                "format": FORMAT,
                "step": next_step,
                "world_size": self.world,
                "samples_seen": samples_seen,
                "segments": [list(s) for s in segments or ((0, self.world),)],
                "config": tomllib.loads(self.config_text),  # the config.toml's values
                "files": files,
            }
            if data is not None:  # where the data was, its schema, example and id maps
                manifest["data"] = data
            with open(partial / MANIFEST, "w") as f:
                f.write(json.dumps(manifest))
                f.flush()
                os.fsync(f.fileno())
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

    def _digests(self, directory: Path) -> dict[str, list]:
        """``[bytes, sha256]`` of every file in ``directory``: rank 0 lists them,
        each rank hashes its `share`, every rank gets all digests."""
        listing = json.loads(
            broadcast_text(json.dumps(list_files(directory)), self.group, self.world)
        )
        mine = share(listing, self.world)[self.rank]
        digests = json.dumps({name: sha256_file(directory / name) for name in mine})
        found: dict[str, str] = {}
        for part in all_gather_text(digests, self.group, self.world):
            found.update(json.loads(part))
        return {name: [size, found[name]] for name, size in listing.items()}

    def _prune(self) -> None:
        """Drop all but the newest ``keep`` (a damaged manifest: left alone)."""
        assert self.directory is not None
        steps = {}
        for c in self.directory.glob(f"{PREFIX}*"):
            with contextlib.suppress(ValueError):
                if (c / MANIFEST).is_file():
                    steps[c] = _step(c)
        done = sorted(steps, key=steps.__getitem__)
        for c in done[: max(0, len(done) - self.keep)]:
            shutil.rmtree(c, ignore_errors=True)

    def load(self, path: Path, tables: nn.Module, replicated: dict[str, Any]) -> DataPosition:
        """Restore everything from ``path`` (written at any world size); return
        where the run continues.

        Every file is checked first (this rank hashes its `share`, all read
        the plain files); the first problem any rank found is every rank's
        ValueError, raised before any state changes.
        """
        trainer, rng, problem = None, None, ""
        try:
            manifest = read_manifest(path)
            sizes = {name: size for name, (size, _) in manifest["files"].items()}
            mine = share(sizes, self.world)[self.rank]
            saved = self.rank if self.rank < manifest["world_size"] else 0
            trainer, rngs = read_checked(path, manifest, [saved], mine)
            rng = rngs[saved]
        except Exception as e:  # any rank's problem is every rank's (no rank left waiting)
            problem = str(e) if isinstance(e, ValueError) else f"checkpoint {path}: {e!r}"
        problem = first_problem(problem, self.group, self.world)
        if problem:
            raise ValueError(problem)
        assert trainer is not None and rng is not None
        for key in ("model", "optimizer"):  # a balancer may be new on resume
            if key in replicated and key not in trainer:
                raise ValueError(f"resume: {path} holds no {key} state")
        load_tables(tables, path / TABLES, process_group=self.group)
        for key, obj in replicated.items():
            if key in trainer:
                obj.load_state_dict(trainer[key])
        set_rng_state(rng)
        world = manifest["world_size"]
        segments = tuple(tuple(s) for s in manifest.get("segments", [[0, world]]))
        return DataPosition(manifest["step"], manifest["samples_seen"], world, segments)

    def load_best(self, path: Path, best: nn.Module) -> None:
        """The best evaluation's rows into ``best`` (after `load`, which checked them)."""
        load_tables(best, path / BEST, process_group=self.group)
