"""Start the ranks of a training run: under ``torchrun``, or spawned by us.

Under ``torchrun`` (RANK/WORLD_SIZE in the environment) this process is one
rank. Otherwise ``cfg.run.nproc`` processes are spawned on this host (gloo on the
CPU, NCCL with one GPU each), around a rendezvous store that lives here, in
the launcher, so that a frozen rank cannot take the store (and the
heartbeats, `freescale.pipeline.liveness`) down with it.

What the launcher guarantees:

- every value that could fail later is checked here first
  (`freescale.pipeline.checks`): a bad config is one line, before any rank;
- a run directory (``output.dir``, `freescale.pipeline.run_dir`) gets its
  ``config.toml`` before any rank starts and ``summary.json`` after the run;
- a rank that raises ends the run at once: the others are killed and
  `RunFailed` carries that rank's one-line error (its traceback went to
  stderr when the error was not a plain input error); a ValueError (bad
  data or input, which the ranks agree on and raise alike) is re-raised as
  `RankInputError`, a ValueError with the rank's line as it is (CLI rc 2,
  as under torchrun, where each rank's own ``main`` exits 2);
- ranks die with the launcher (``PR_SET_PDEATHSIG``), SIGKILL included;
- SIGTERM is forwarded: the ranks finish their step, checkpoint if
  configured and return their summary (``"stopped": "SIGTERM"``); the CLI
  then exits 143.
"""

from __future__ import annotations

import io
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from freescale.pipeline.checks import check_launch
from freescale.pipeline.config import TrainConfig
from freescale.pipeline.export import full_state_dict
from freescale.pipeline.liveness import EXIT_STOPPED, die_with_parent, was_stopped
from freescale.pipeline.nonfinite import NonFiniteError
from freescale.pipeline.run_dir import write_config, write_summary
from freescale.pipeline.train import Trainer


class RunFailed(RuntimeError):
    """A rank failed; the message names the rank and its error, on one line."""


class RankInputError(RunFailed, ValueError):
    """A rank raised a ValueError (bad data or input): its one line, as it is."""


EXIT_INPUT = 2  # a spawned rank's exit status after a ValueError (its line went to the launcher)


def _backend(cfg: TrainConfig) -> str:
    cuda = cfg.run.device == "cuda" or (cfg.run.device == "auto" and torch.cuda.is_available())
    return "nccl" if cuda else "gloo"


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(
    cfg: TrainConfig,
    model: Any = None,
    data: Any = None,
    state_dict: bool | None = None,
    checked: bool = False,
) -> dict[str, Any] | None:
    """Run training; return rank 0's summary (None on other torchrun ranks).

    Python API (`freescale.api`): ``model`` / ``data`` objects replace the
    config's, and with ``state_dict`` not None rank 0 returns
    ``{"summary", "steps", "state_dict"}``; one rank then runs in this
    process (no pickling of what a notebook defined). ``checked``: the
    caller ran `check_launch` already (the CLI does, before its data check);
    it is not repeated (it hashes a resumed checkpoint).
    """
    if not checked:
        check_launch(cfg, model_given=model is not None)
    job = RankJob(model, data, state_dict)
    if int(os.environ.get("RANK", "0")) == 0:
        write_config(cfg)  # a run directory's config.toml, before any rank starts
    out = _launch(cfg, job)
    if out is not None:
        write_summary(cfg, out["summary"] if job.api else out)
    return out


def _launch(cfg: TrainConfig, job: RankJob) -> dict[str, Any] | None:
    if under_torchrun():
        die_with_parent()  # the torchrun agent
        return _run_initialized(
            cfg, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), job=job
        )
    if _backend(cfg) == "nccl" and cfg.run.nproc > torch.cuda.device_count():
        raise ValueError(f"nproc={cfg.run.nproc} but only {torch.cuda.device_count()} GPUs")
    if job.api and cfg.run.nproc == 1:
        if dist.is_initialized():
            raise ValueError("freescale.train at nproc=1 needs no process group of the caller's")
        os.environ.setdefault("LOCAL_RANK", "0")
        store = dist.HashStore()
        return _run_initialized(cfg, 0, 1, store, job)
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        cfg.run.nproc + 1,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=cfg.run.timeout_s),
    )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_spawned,
            args=(rank, cfg, store.port, results, os.getpid(), job),
            daemon=False,
        )
        for rank in range(cfg.run.nproc)
    ]
    with _forward_sigterm(procs):
        for p in procs:
            p.start()
        try:
            return _join(procs, results, cfg)
        finally:
            _kill(procs)
            del store


def _join(procs: list[Any], results: Any, cfg: TrainConfig) -> dict[str, Any] | None:
    """Wait for the ranks; the first failure kills the rest and raises `RunFailed`."""
    summary, errors = None, []
    done_since: float | None = None
    while any(p.exitcode is None for p in procs):
        multiprocessing.connection.wait([p.sentinel for p in procs], timeout=0.5)
        summary = _drain(results, errors, summary)
        failed = [p for p in procs if p.exitcode not in (None, 0, EXIT_STOPPED)]
        if failed or errors:
            _kill(procs)
            break
        if done_since is None and any(p.exitcode is not None for p in procs):
            done_since = time.monotonic()
        if done_since is not None and time.monotonic() - done_since > cfg.run.timeout_s:
            break  # one rank finished, another never did: don't wait forever
    deadline = time.monotonic() + 1.0  # what a failing rank sent may still be in the pipe
    while time.monotonic() < deadline and summary is None and not errors:
        summary = _drain(results, errors, summary, block=0.1)
    if errors:
        # a rank's ValueError first: another rank's error may only be its peer gone
        kind, rank, message = min(errors, key=lambda error: error[0] != "input")
        if kind == "input":
            raise RankInputError(message)
        raise RunFailed(f"rank {rank} failed: {message}")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, EXIT_STOPPED)]
    if bad:
        rank, code = bad[0]
        how = "did not finish" if code is None else f"exited with code {code}"
        raise RunFailed(f"rank {rank} {how} (killed, or crashed without a Python error)")
    return summary


def _drain(results: Any, errors: list, summary: Any, block: float = 0.0) -> Any:
    while True:
        try:
            kind, rank, payload = results.get(timeout=block) if block else results.get_nowait()
        except queue.Empty:
            return summary
        if kind == "summary":
            summary = payload
        elif kind == "result":  # the Python API's: tensors, loaded without running code
            summary = torch.load(io.BytesIO(payload), weights_only=True)
        else:
            errors.append((kind, rank, payload))


class _forward_sigterm:
    """While the ranks run, SIGTERM to the launcher is passed on to each rank."""

    def __init__(self, procs: list[Any]) -> None:
        self.procs, self.previous = procs, None

    def _handler(self, signum: int, frame: Any) -> None:
        for p in self.procs:
            if p.pid is not None and p.exitcode is None:
                os.kill(p.pid, signal.SIGTERM)

    def __enter__(self) -> _forward_sigterm:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.exitcode is None and p.pid is not None:
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(timeout=5)


def _rank_threads(nproc: int) -> int:
    """A CPU rank's intra-op threads: ``OMP_NUM_THREADS`` when set (the user's
    choice, and the numeric test matrix's), else the cores shared evenly."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, (os.cpu_count() or 1) // nproc)


class RankJob:
    """What a rank runs besides the config: the Python API's objects."""

    def __init__(self, model: Any = None, data: Any = None, state_dict: bool | None = None):
        self.model, self.data, self.state_dict = model, data, state_dict

    @property
    def api(self) -> bool:
        """Called from `freescale.api.train` (rank 0 returns the full result)."""
        return self.state_dict is not None


def _spawned(
    rank: int, cfg: TrainConfig, port: int, results: Any, launcher: int, job: RankJob
) -> None:
    die_with_parent(launcher)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(cfg.run.nproc),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(cfg.run.nproc),
    )
    if _backend(cfg) == "gloo":
        torch.set_num_threads(_rank_threads(cfg.run.nproc))
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cfg.run.timeout_s)
    )
    try:
        summary = _run_initialized(cfg, rank, cfg.run.nproc, store, job)
    except BaseException as e:
        # input and non-finite errors are one line; the rest keep a trace
        if not isinstance(e, (ValueError, NonFiniteError)):
            traceback.print_exc()
        if isinstance(e, ValueError):
            results.put(("input", rank, (str(e).splitlines() or [""])[0]))
        else:
            results.put(("error", rank, f"{type(e).__name__}: {e}".splitlines()[0]))
        results.close()
        results.join_thread()
        sys.exit(EXIT_INPUT if isinstance(e, ValueError) else 1)
    if rank == 0 and job.api:
        buffer = io.BytesIO()
        torch.save(summary, buffer)
        results.put(("result", rank, buffer.getvalue()))
        results.close()
        results.join_thread()
    elif rank == 0:
        results.put(("summary", rank, summary))
        results.close()
        results.join_thread()
    if was_stopped():
        sys.exit(EXIT_STOPPED)


def _run_initialized(
    cfg: TrainConfig, rank: int, world: int, store: Any = None, job: RankJob | None = None
) -> dict[str, Any] | None:
    backend = _backend(cfg)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())
    timeout = timedelta(seconds=cfg.run.timeout_s)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, store=store)
    try:
        job = job or RankJob()
        return run_rank(cfg, job.model, job.data, job.state_dict)
    finally:
        dist.destroy_process_group()


def run_rank(
    cfg: TrainConfig, model: Any = None, data: Any = None, state_dict: bool | None = None
) -> dict[str, Any] | None:
    """Train on this rank (process group initialized); rank 0 returns the summary
    (with ``state_dict`` not None, the Python API's result: `freescale.api`).

    A collective that timed out is re-raised naming the stuck rank(s).
    """
    trainer = Trainer(cfg, model, data)
    try:
        summary = trainer.run()
        if state_dict is None:
            return summary
        state = None
        if state_dict:  # a collective: every rank gathers
            state = full_state_dict(trainer.model, trainer.embeddings, trainer.sparse.swapped)
        if trainer.rank != 0:
            return None
        return {"summary": summary, "steps": trainer.summary.steps, "state_dict": state}
    except RuntimeError as e:
        explained = trainer.liveness.explain_timeout(e)
        if explained is None:
            raise
        raise RuntimeError(explained) from e
