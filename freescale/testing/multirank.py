"""Run a function on N CPU ranks over gloo, as separate processes.

Every distributed test uses `run_ranks`. A rank that raises fails the call
with that rank's traceback; a rank that hangs (or dies) fails it by timeout.
Other ranks are killed, so a test never leaves processes blocked in a
collective and never blocks CI.

Each rank runs torch with one intra-op thread (ranks share the machine's
cores), or ``FREESCALE_TEST_THREADS`` of them, which tests/conftest.py also
gives the test process itself: scripts/numeric_matrix.sh sets it so that every
reduction splits as the matrix's thread count says (torch caps
``OMP_NUM_THREADS`` at the cores it sees; an explicit count is kept).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

_CTX: Any = None
THREADS_ENV = "FREESCALE_TEST_THREADS"


def rank_threads() -> int:
    """Intra-op threads of a rank: ``FREESCALE_TEST_THREADS``, else 1."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if not value:
        return 1
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{THREADS_ENV} must be a positive integer, got {value!r}")
    return int(value)


class RankError(RuntimeError):
    """A rank raised; the message holds that rank's traceback."""


class RankTimeout(RuntimeError):
    """Ranks neither returned nor raised within the timeout."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context() -> Any:
    # A forkserver that has imported torch once makes each rank start in
    # ~0.1 s instead of re-importing torch (~2 s) as spawn would.
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "freescale"])
    return _CTX


def _worker(
    rank: int,
    world_size: int,
    port: int,
    timeout_s: float,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(rank_threads())
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        # The caller's store holds the port (see run_ranks): this is a client of it.
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s)
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        out = fn(*args)
        # Serialize here: tensors sent through a Queue share storage via file
        # descriptors of this process, which is gone by the time they're read.
        # Plain pickle: the harness's own IPC, between a test and the ranks it
        # started (trusted; docs/security.md).
        results.put(("ok", rank, pickle.dumps(out)))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0
) -> list[Any]:
    """Call ``fn(*args)`` on ``world_size`` gloo ranks; return each rank's result.

    ``fn`` and ``args`` must be picklable (define ``fn`` at module level).
    Inside ``fn`` the default process group is initialized and
    ``torch.distributed.get_rank()`` gives the rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    import torch.distributed as dist

    ctx = _context()
    results = ctx.Queue()
    # The rendezvous store lives here, bound to a port the OS picks and held
    # until the ranks are done: a port found free and then bound by a rank
    # could be taken in between by a concurrent run (pytest-xdist, CI).
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    procs = [
        ctx.Process(
            target=_worker, args=(r, world_size, port, timeout, fn, args, results), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        outputs = _collect(procs, results, world_size, timeout)
    except BaseException:
        _kill(procs)
        raise
    for p in procs:
        p.join(timeout=10)
    _kill(procs)
    del store
    return [outputs[r] for r in range(world_size)]


def _collect(procs: list[Any], results: Any, world_size: int, timeout: float) -> dict[int, Any]:
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(outputs) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(set(range(world_size)) - set(outputs))
            raise RankTimeout(f"ranks {missing} did not finish within {timeout:.0f} s")
        try:
            status, rank, payload = results.get(timeout=min(remaining, 0.5))
        except queue_mod.Empty:
            dead = [r for r, p in enumerate(procs) if r not in outputs and p.exitcode is not None]
            if dead:
                # A rank that died without reporting (crash, os._exit): give the
                # queue a moment to deliver anything it sent, then fail.
                deadline = min(deadline, time.monotonic() + 2.0)
                if remaining <= 2.0:
                    code = procs[dead[0]].exitcode
                    raise RankError(_crash(dead[0], code)) from None
            continue
        if status == "error":
            crashed = _crashed_peer(procs, outputs, reporter=rank)
            if crashed is not None:
                # The raise is often the echo of the crash (a peer's socket
                # reset), so the crash is named first.
                r, code = crashed
                raise RankError(
                    f"{_crash(r, code)}; after it, rank {rank} of {world_size} raised:\n{payload}"
                )
            raise RankError(f"rank {rank} of {world_size} raised:\n{payload}")
        outputs[rank] = pickle.loads(payload)  # from a rank this call started
    return outputs


def _crash(rank: int, code: int | None) -> str:
    return f"rank {rank} exited with code {code} without a result"


def _crashed_peer(
    procs: list[Any], outputs: dict[int, Any], reporter: int, grace: float = 2.0
) -> tuple[int, int] | None:
    """A rank other than ``reporter`` that exited non-zero without a result.

    Waits up to ``grace`` seconds for one: the crash that caused a peer's
    error is usually a few milliseconds from being reaped.
    """
    from multiprocessing.connection import wait

    waiting = {p.sentinel: r for r, p in enumerate(procs) if r != reporter and r not in outputs}
    deadline = time.monotonic() + grace
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        for sentinel in wait(list(waiting), timeout=remaining):
            r = waiting.pop(sentinel)
            code = procs[r].exitcode
            if code is None:
                procs[r].join(timeout=1)
                code = procs[r].exitcode
            if code:
                return r, code
    return None


def _kill(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
    for p in procs:
        p.join(timeout=5)
