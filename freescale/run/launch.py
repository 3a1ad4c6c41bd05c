"""Start the ranks of a training run: under ``torchrun``, or spawned by us.

Under ``torchrun`` (RANK/WORLD_SIZE in the environment) this process is one
rank. Otherwise ``cfg.run.nproc`` processes are spawned on this host (gloo on the
CPU, NCCL with one GPU each), around a rendezvous store that lives here, in
the launcher, so that a frozen rank cannot take the store (and the
heartbeats, `freescale.pipeline.liveness`) down with it.

What the launcher guarantees:

- every value that could fail later is checked here first
  (`freescale.run.checks`): a bad config is one line, before any rank;
- it watches the ranks' processes, not only their messages
  (`freescale.run.supervise`): a rank that ends early, for any reason,
  ends the run within the wait; the others are killed and `RunFailed` names
  the rank with its error, or its exit code or signal and the last lines of
  its stderr (`freescale.run.rank_stderr`); a ValueError (bad data or
  input, which the ranks agree on and raise alike) is `RankInputError`, a
  ValueError with the rank's line as it is (CLI rc 2, as under torchrun);
- a script that trains at its top level without the
  ``if __name__ == "__main__":`` guard fails with one line saying so;
- a run directory (``output.dir``, `freescale.run.run_dir`) gets its
  ``config.toml`` before any rank starts and ``summary.json`` after the run;
- ranks die with the launcher (``PR_SET_PDEATHSIG``), SIGKILL included;
- SIGTERM is forwarded: the ranks finish their step, checkpoint if
  configured and return their summary (``"stopped": "SIGTERM"``); the CLI
  then exits 143. A rank that has not built its trainer yet ends at once;
  SIGINT ends every rank at once; a second signal kills them (`RunStopped`:
  143, 130).
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import pickle
import signal
import sys
import tempfile
import traceback
from datetime import timedelta
from multiprocessing import resource_tracker
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from freescale.comm.torch_backend import end_process_groups
from freescale.config import TrainConfig
from freescale.pipeline.liveness import (
    EXIT_STOPPED,
    attempt_store,
    die_with_parent,
    was_stopped,
)
from freescale.pipeline.nonfinite import NonFiniteError
from freescale.pipeline.train import Trainer
from freescale.run.checks import check_launch
from freescale.run.rank_stderr import RankStderr
from freescale.run.run_dir import write_config, write_summary
from freescale.run.supervise import (
    EXIT_INPUT,
    Rank,
    RankInputError,
    RunFailed,
    RunStopped,
    StopSignals,
    Supervisor,
    kill,
)
from freescale.state.export import full_state_dict

__all__ = ["RankInputError", "RunFailed", "RunStopped", "launch", "run_rank", "under_torchrun"]


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
    if _bootstrapping():
        raise RuntimeError(GUARD_HINT)
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
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        return _run_initialized(cfg, rank, world, _agent_store(cfg), job)
    if _backend(cfg) == "nccl" and cfg.run.nproc > torch.cuda.device_count():
        raise ValueError(f"nproc={cfg.run.nproc} but only {torch.cuda.device_count()} GPUs")
    if job.api and cfg.run.nproc == 1:
        if dist.is_initialized():
            raise ValueError("freescale.train at nproc=1 needs no process group of the caller's")
        os.environ.setdefault("LOCAL_RANK", "0")
        store = dist.HashStore()
        return _run_initialized(cfg, 0, 1, store, job)
    return _spawn(cfg, job)


def _agent_store(cfg: TrainConfig) -> Any:
    """Under torchrun with the agent's store (its default): this attempt's part of
    it (`liveness.attempt_store`), or None: ``env://`` as torchrun set it up."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=cfg.run.timeout_s)
    return attempt_store(dist.TCPStore(addr, port, is_master=False, timeout=timeout))


# A script that trains at module level, unguarded, runs again in each spawned
# rank as Python imports it there (the spawn start method): stop it there.
GUARD_HINT = (
    "a rank ran the training script's top level again while starting: put the call"
    ' to freescale.train under `if __name__ == "__main__":`'
)


def _check_main_importable() -> None:
    """A spawned rank imports the main script again, by its path: one read from
    standard input (``python -``) has none (every rank would fail to start)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is None and path and not os.path.isfile(path):
        raise ValueError(
            f"spawned ranks import the main script again, and {path!r} is not a file:"
            " save the script to a file (with the"
            ' `if __name__ == "__main__":` guard), or run nproc=1 or under torchrun'
        )


def _bootstrapping() -> bool:
    """Whether this process is a spawned child still importing its main module."""
    return bool(getattr(mp.current_process(), "_inheriting", False))


def _spawn(cfg: TrainConfig, job: RankJob) -> dict[str, Any] | None:
    """Spawn ``cfg.run.nproc`` ranks around a store of ours; watch them (`supervise`)."""
    _check_main_importable()
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        cfg.run.nproc + 1,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=cfg.run.timeout_s),
    )
    ctx = mp.get_context("spawn")
    resource_tracker.ensure_running()  # now, not with rank 0's stderr
    with JobFile(job) as job_path, StopSignals() as stop:
        try:
            for rank in range(cfg.run.nproc):
                if stop.received is not None:
                    break  # stopped while starting: start no more
                messages, rank_end = ctx.Pipe(duplex=False)
                process = ctx.Process(
                    target=_spawned,
                    args=(rank, cfg, store.port, rank_end, os.getpid(), job.to_spawn(job_path)),
                    daemon=False,
                )
                stderr = RankStderr()
                with stderr.attached():
                    process.start()
                stderr.started()
                rank_end.close()  # the rank holds it now: EOF when it exits
                stop.ranks.append(Rank(rank, process, messages, stderr))
                stop.forward()  # a signal that came while it started
            return Supervisor(stop.ranks, stop, cfg.run.timeout_s).run()
        finally:
            kill(stop.ranks)
            del store


class JobFile:
    """The Python API's model and data, pickled once into a private file the
    ranks read: not through the pipe that starts a rank, where a rank that
    dies before reading it all would block the launcher for good."""

    def __init__(self, job: RankJob) -> None:
        self.job, self.path = job, None

    PREFIX = "freescale-job-"

    def __enter__(self) -> str | None:
        if self.job.model is None and self.job.data is None:
            return None
        self.sweep(tempfile.gettempdir())
        prefix = f"{self.PREFIX}{os.getpid()}-"
        fd, self.path = tempfile.mkstemp(prefix=prefix, suffix=".pkl")
        with os.fdopen(fd, "wb") as f:
            pickle.dump((self.job.model, self.job.data), f)
        return self.path

    def __exit__(self, *exc: Any) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    @classmethod
    def sweep(cls, folder: str) -> None:
        """Remove this user's job files whose launcher is gone (SIGKILLed before
        its ``__exit__``): named by the launcher's pid, they are stale when no
        process has it (a reused pid keeps a file: it is only left for later)."""
        for path in glob.glob(os.path.join(folder, f"{cls.PREFIX}*-*.pkl")):
            pid = os.path.basename(path)[len(cls.PREFIX) :].partition("-")[0]
            with contextlib.suppress(OSError, ValueError):
                if os.stat(path).st_uid == os.getuid() and not _alive(int(pid)):
                    os.unlink(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _rank_threads(nproc: int) -> int:
    """A CPU rank's intra-op threads: ``OMP_NUM_THREADS`` when set (the user's
    choice, and the numeric test matrix's), else the cores shared evenly."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, (os.cpu_count() or 1) // nproc)


class RankJob:
    """What a rank runs besides the config: the Python API's objects (in a
    spawned rank: read from ``path``, the launcher's `JobFile`)."""

    def __init__(
        self,
        model: Any = None,
        data: Any = None,
        state_dict: bool | None = None,
        path: str | None = None,
    ) -> None:
        self.model, self.data, self.state_dict, self.path = model, data, state_dict, path

    def to_spawn(self, path: str | None) -> RankJob:
        """What a spawned rank is given: the flags, and the file with the objects."""
        return RankJob(state_dict=self.state_dict, path=path)

    def loaded(self) -> RankJob:
        if self.path is None:
            return self
        with open(self.path, "rb") as f:
            model, data = pickle.load(f)  # written by this run's launcher
        return RankJob(model, data, self.state_dict)

    @property
    def api(self) -> bool:
        """Called from `freescale.api.train` (rank 0 returns the full result)."""
        return self.state_dict is not None


def _spawned(
    rank: int, cfg: TrainConfig, port: int, messages: Any, launcher: int, job: RankJob
) -> None:
    """A spawned rank: train, send the launcher the summary (rank 0) or the error."""
    die_with_parent(launcher)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C / the launcher's SIGINT: end now
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
    try:
        job = job.loaded()
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cfg.run.timeout_s)
        )
        summary = _run_initialized(cfg, rank, cfg.run.nproc, store, job)
    except SystemExit:
        raise  # its code and what it printed reach the launcher as they are
    except BaseException as e:
        # input and non-finite errors are one line; the rest keep a trace
        if not isinstance(e, (ValueError, NonFiniteError)):
            traceback.print_exc()
        if isinstance(e, ValueError):
            messages.send(("input", (str(e).splitlines() or [""])[0]))
        else:
            messages.send(("error", f"{type(e).__name__}: {e}".splitlines()[0]))
        sys.exit(EXIT_INPUT if isinstance(e, ValueError) else 1)
    if rank == 0 and job.api:
        buffer = io.BytesIO()
        torch.save(summary, buffer)
        messages.send(("result", buffer.getvalue()))
    elif rank == 0:
        messages.send(("summary", summary))
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
        end_process_groups()


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
