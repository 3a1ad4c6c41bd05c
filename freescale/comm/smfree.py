"""`SmFreeCommunicator`: AllGather and AllToAll without GPU kernels (paper §3.3, §6.3).

The data path of one collective:

    caller thread   all_gather(x): record the producer event on the current
                    stream, allocate the output, queue the job  (microseconds)
    helper thread   copy streams wait for the producer event
                    per chunk: D2H into host buffers (pinned / shared memory)
                               -> host transport (shm, gloo, hier) -> H2D
                    fence, record the done event, mark the job done
    caller thread   work.wait(stream): block until the job is marked done,
                    make ``stream`` wait for the done event, return the output

No kernel is launched for the data movement: contiguous byte copies between
host and device are ``cudaMemcpyAsync`` on copy streams, the transports use
the CPU. This rank's own piece is one device-to-device ``copy_`` (also a
memcpy). On the CPU the copies are plain ``copy_`` and the same code runs,
which is how CI checks the protocol and the transports.

Semantics: those of `freescale.comm.protocol`, with one difference on the
GPU. ``wait`` blocks the host until the *host* side of the collective is
finished (as gloo does), since the H2D copies can only be enqueued once the
data has reached this host; after that the GPU does not wait at all (the
copies have completed). Inputs must not be modified before ``wait``.

The helper thread runs the jobs in issue order, so all ranks run the same
collectives in the same order, as the protocol requires of callers. Its
blocking calls (socket reads, gloo waits, stream synchronizes, large copies)
release the GIL, so the training thread keeps launching work meanwhile.

Failures: transports raise `PeerError` naming the peer within ``timeout``
seconds of silence; the job's ``wait`` re-raises it and every later
collective of this communicator fails at once with the same error (its
pairwise sequence numbers can no longer be trusted). ``close()`` (also run
at interpreter exit) stops the thread and frees buffers and segments.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from freescale.comm.protocol import check_counts
from freescale.comm.transport import Copier, Transport, as_bytes, split

DEFAULT_TIMEOUT = 300.0


class SmFreeWork:
    """Handle of a collective run by the helper thread."""

    def __init__(self, output: Tensor, worker: _Worker) -> None:
        self._output = output
        self._worker = worker
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.event: torch.cuda.Event | None = None

    def wait(self, stream: torch.Stream | None = None) -> Tensor:
        while not self.done.wait(1.0):
            if not self._worker.thread.is_alive():
                raise RuntimeError("the smfree helper thread stopped (communicator closed?)")
        if self.error is not None:
            raise self.error
        if self.event is not None:
            device = self._output.device
            consumer = stream if stream is not None else torch.cuda.current_stream(device)
            consumer.wait_event(self.event)
            self._output.record_stream(consumer)
        return self._output


class _Worker:
    """The helper thread: runs queued jobs in order (see module doc)."""

    def __init__(self, copier: Copier) -> None:
        self.device = copier.device
        self.copier = copier
        self.jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.error: BaseException | None = None
        self.transport: Transport | None = None
        self.thread = threading.Thread(target=self._run, name="smfree-helper", daemon=True)

    def _run(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        copier = self.copier
        while True:
            job = self.jobs.get()
            if job is None:
                return
            body, work, producer = job
            try:
                if self.error is not None:
                    raise self.error
                copier.begin(producer)
                body(copier)
                copier.fence()
                work.event = copier.done_event()
            except BaseException as exc:
                self.error = self.error or exc
                work.error = self.error
            work.done.set()

    def close(self, join_s: float = 2.0) -> None:
        if self.thread.is_alive():
            self.jobs.put(None)
            self.thread.join(join_s)
        if self.transport is not None and not self.thread.is_alive():
            self.transport.close()  # buffers are freed only once nothing uses them
            self.transport = None


class SmFreeCommunicator:
    """A `Communicator` whose data moves by copy engines and host transports.

    Build it with `freescale.comm.make_communicator`, which builds the
    transport for the topology (a collective over all ranks of the default
    group: every rank calls it, in the same order). ``all_gather_impl``
    replaces the flat AllGather (the hierarchical one for several hosts);
    ``why``: how the transport was chosen (the run summary shows it).
    """

    def __init__(
        self,
        transport: Transport,
        copier: Copier,
        all_gather_impl: Callable[[Copier, Tensor, Tensor], None] | None = None,
        why: str = "",
    ) -> None:
        if not dist.is_initialized():
            raise ValueError("SmFreeCommunicator needs an initialized torch.distributed group")
        self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        self._device = copier.device
        self.transport = transport
        self.why = why
        self._gather_impl = all_gather_impl
        self._lock = threading.Lock()
        self._worker = _Worker(copier)
        self._worker.transport = transport
        self._worker.thread.start()
        self._finalizer = weakref.finalize(self, self._worker.close)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def device(self) -> torch.device:
        return self._device

    def close(self) -> None:
        """Stop the helper thread; free buffers, sockets and shared memory. Idempotent."""
        self._finalizer()

    # ---- issuing -------------------------------------------------------------
    def _issue(self, x: Tensor, out: Tensor, body: Callable[[Copier], None]) -> SmFreeWork:
        if not self._worker.thread.is_alive():
            raise RuntimeError("this smfree communicator is closed")
        work = SmFreeWork(out, self._worker)
        producer = None
        if self._device.type == "cuda":
            producer = torch.cuda.Event()
            producer.record(torch.cuda.current_stream(self._device))
        with self._lock:  # one order of jobs, even if several threads issue
            self._worker.jobs.put((body, work, producer))
        return work

    def _check(self, x: Tensor) -> Tensor:
        if x.device != self._device:
            raise ValueError(f"input on {x.device}, but this communicator is on {self._device}")
        if x.dim() < 1:
            raise ValueError("collectives need a tensor with at least one dimension")
        return x.contiguous()

    def all_gather(self, x: Tensor) -> SmFreeWork:
        x = self._check(x)
        out = x.new_empty((self._world_size * x.shape[0], *x.shape[1:]))
        xb, ob, t, r, w = as_bytes(x), as_bytes(out), self.transport, self._rank, self._world_size
        gather = self._gather_impl

        def body(copier: Copier) -> None:
            if gather is not None:
                gather(copier, xb, ob)
            else:
                _flat_all_gather(t, r, w, copier, xb, ob)

        return self._issue(x, out, body)

    def all_to_all_v(
        self, x: Tensor, send_counts: Sequence[int], recv_counts: Sequence[int]
    ) -> SmFreeWork:
        send, recv = check_counts(x, send_counts, recv_counts, self._world_size)
        x = self._check(x)
        out = x.new_empty((sum(recv), *x.shape[1:]))
        row = x.element_size() * _row_numel(x)  # bytes per row of dim 0
        xb, ob, t, r = as_bytes(x), as_bytes(out), self.transport, self._rank

        def body(copier: Copier) -> None:
            _all_to_all_v(t, r, copier, xb, ob, [c * row for c in send], [c * row for c in recv])

        return self._issue(x, out, body)


def _row_numel(x: Tensor) -> int:
    n = 1
    for s in x.shape[1:]:
        n *= s
    return n


def _offsets(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for s in sizes:
        out.append(total)
        total += s
    return out


def _flat_all_gather(
    t: Transport, rank: int, world: int, copier: Copier, xb: Tensor, ob: Tensor
) -> None:
    """Every peer gets every chunk of ``xb`` directly (one broadcast per round)."""
    n = xb.numel()
    copier.copy(ob[rank * n : (rank + 1) * n], xb)
    peers = [p for p in range(world) if p != rank]
    for a, b in split(n, t.chunk_bytes) if peers else []:
        src = xb[a:b]
        t.exchange([(p, src) for p in peers], [(p, ob[p * n + a : p * n + b]) for p in peers])


def _all_to_all_v(
    t: Transport,
    rank: int,
    copier: Copier,
    xb: Tensor,
    ob: Tensor,
    send: list[int],
    recv: list[int],
) -> None:
    """Pairwise chunks: the k-th round carries bytes [k*c, (k+1)*c) of every pair's message."""
    so, ro, c = _offsets(send), _offsets(recv), t.chunk_bytes
    copier.copy(ob[ro[rank] : ro[rank] + recv[rank]], xb[so[rank] : so[rank] + send[rank]])
    peers = [p for p in range(len(send)) if p != rank]
    rounds = max([-(-send[p] // c) for p in peers] + [-(-recv[p] // c) for p in peers] + [0])
    for k in range(rounds):
        a = k * c
        sends = [(p, xb[so[p] + a : so[p] + min(a + c, send[p])]) for p in peers if a < send[p]]
        recvs = [(p, ob[ro[p] + a : ro[p] + min(a + c, recv[p])]) for p in peers if a < recv[p]]
        t.exchange(sends, recvs)
