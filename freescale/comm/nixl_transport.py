"""`NixlTransport`: the SM-free rounds as one-sided NIXL writes (UCX: RDMA, TCP or shm).

One NIXL agent per rank and communicator, its backend a parameter (``UCX``
by default; ``LIBFABRIC`` for EFA). UCX picks the wire itself: InfiniBand or
RoCE verbs between hosts where devices exist, TCP otherwise, shared memory
inside a host.

Buffers, registered once at construction: a receive region of
``slots_per_peer`` (2) slots of ``chunk_bytes`` for each peer, then one send
slot per peer. On the host they are pinned (page-locked) memory, so the copy
engines write into them; with ``staging="device"`` they are GPU memory and
UCX moves GPU memory directly (`freescale.comm.nixl_support`).

Setup: a token from rank 0; each rank publishes its agent's metadata, the
address of its receive region and the offset of every peer's slots under
``freescale-nixl-<token>/<rank>`` in the run's own ``torch.distributed`` store
(no new port, no side service), loads its peers' entries, and deletes its
key after a barrier.

Protocol per ordered pair s -> d (as `shm`'s, with NIXL notifications in
place of socket messages; each notification is ``kind, seq, nbytes``):

1. s waits until its slot ``seq % slots`` in d's region is free: d has
   acknowledged message ``seq - slots``;
2. s copies the chunk into its send slot (D2H), fences, and posts a
   ``WRITE`` of it into that slot of d's region carrying the notification
   ``DATA(seq, nbytes)``, which NIXL delivers after the bytes (a chunk in
   host memory is instead registered for the round and written from where
   it is: one copy fewer);
3. d, expecting message ``seq`` from s, waits for that notification
   (notifications are matched by ``seq``, so their arrival order does not
   matter), checks ``nbytes``, copies the slot out and fences;
4. d sends ``ACK(seq)``; s waits for its own writes to complete before the
   round returns (its send slots are reused next round).

Two slots per peer let chunk k+1 land while chunk k is read. Waiting polls
the agent (no progress thread: an idle one used ~28% of a core, measured on
the CPU), sleeping between polls. A peer silent for ``timeout`` seconds, or
whose connection failed, raises `PeerError` naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from freescale.comm.nixl_support import nixl_api, pick_staging, ucx_excludes_cuda
from freescale.comm.transport import Copier, PeerError, Transfer, pinned_empty

_NOTE = struct.Struct("<bqq")  # kind, seq, nbytes
_DATA, _ACK, _PING = 1, 2, 3
_MAX_SLEEP_S = 0.0005
_PING_AFTER_S = 0.5  # silence after which a waiting rank checks that the peer is still there


class NixlTransport:
    """Pairwise rounds over NIXL between this rank and ``peers`` (see module doc).

    Construction is collective over ``group`` (a gloo group of all ranks;
    ranks without peers here take part in its broadcast and barrier only).
    """

    name = "nixl"

    def __init__(
        self,
        group: Any,
        store: Any,
        peers: Sequence[int],
        copier: Copier,
        chunk_bytes: int,
        timeout: float,
        *,
        backend: str = "UCX",
        staging: str = "host",
        slots_per_peer: int = 2,
    ) -> None:
        if chunk_bytes < 1 or slots_per_peer < 1:
            raise ValueError("chunk_bytes and slots_per_peer must be >= 1")
        self.rank = dist.get_rank(group)
        self.peers = sorted(p for p in peers if p != self.rank)
        self.backend = backend
        self._copier, self._chunk, self._slots = copier, chunk_bytes, slots_per_peer
        self._timeout = timeout
        self._send_seq = {p: 0 for p in self.peers}
        self._recv_seq = {p: 0 for p in self.peers}
        self._arrived: dict[int, dict[int, int]] = {p: {} for p in self.peers}  # seq -> nbytes
        self._acked: dict[int, set[int]] = {p: set() for p in self.peers}
        self._names: dict[int, str] = {}
        self._remote: dict[int, dict[str, Any]] = {}
        self._rank_of: dict[str, int] = {}
        self._writes: list[tuple[int, Any]] = []
        self._in_place: list[Any] = []  # host sources registered for the current round
        self._agent: Any = None
        self._registered: Any = None
        self._pool: Tensor | None = None
        api = nixl_api()
        token = [uuid.uuid4().hex[:12] if self.rank == 0 else None]
        dist.broadcast_object_list(token, group=group, group_src=0)
        self._prefix = f"freescale-nixl-{token[0]}"
        config = api.nixl_agent_config(enable_prog_thread=False, backends=[backend])
        self._agent = api.nixl_agent(f"{self._prefix}-{self.rank}", config)
        if backend not in self._agent.backends:
            raise ValueError(
                f"NIXL backend {backend!r} is not available here (plugins:"
                f" {', '.join(self._agent.get_plugin_list())})"
            )
        self.staging, self.staging_why = pick_staging(staging, copier.device, self._probe_vram)
        try:
            self._setup(group, dist.PrefixStore(self._prefix, store))
        except BaseException:
            self.close()
            raise

    @property
    def chunk_bytes(self) -> int:
        return self._chunk

    # ---- setup and teardown -------------------------------------------------
    def _probe_vram(self) -> tuple[bool, str]:
        """Can GPU memory be registered with this backend? (the device path)"""
        if ucx_excludes_cuda(os.environ):
            return False, "UCX_TLS names no CUDA transport"
        if "VRAM_SEG" not in self._agent.get_backend_mem_types(self.backend):
            return False, f"the NIXL {self.backend} backend does not take GPU memory"
        probe = torch.empty(4096, dtype=torch.uint8, device=self._copier.device)
        try:
            descs = self._agent.register_memory(probe)
        except Exception as exc:
            return False, f"registering GPU memory failed ({type(exc).__name__}: {exc})"
        self._agent.deregister_memory(descs)
        return True, f"GPU memory registers with NIXL {self.backend}"

    def _setup(self, group: Any, store: Any) -> None:
        n = len(self.peers)
        recv_bytes = n * self._slots * self._chunk
        nbytes = recv_bytes + n * self._chunk
        if self.staging == "device":
            self._pool = torch.empty(nbytes, dtype=torch.uint8, device=self._copier.device)
        else:
            self._pool = pinned_empty(nbytes, self._copier.device)
        self._recv_region = self._pool[:recv_bytes]
        self._send_region = self._pool[recv_bytes:]
        if n:
            self._registered = self._agent.register_memory(self._pool)
        entry = {
            "addr": self._pool.data_ptr(),
            "device": max(self._pool.get_device(), 0),
            "mem": "VRAM" if self._pool.is_cuda else "DRAM",
            "regions": {str(p): i * self._slots * self._chunk for i, p in enumerate(self.peers)},
        }
        # JSON, a newline, then NIXL's own metadata bytes: nothing here is unpickled.
        store.set(
            str(self.rank), json.dumps(entry).encode() + b"\n" + self._agent.get_agent_metadata()
        )
        for p in self.peers:
            try:
                store.wait([str(p)], timedelta(seconds=self._timeout))
            except Exception as exc:
                raise PeerError(p, f"never published its NIXL metadata ({exc})") from None
            head, _, metadata = store.get(str(p)).partition(b"\n")
            info = json.loads(head)
            info["regions"] = {int(k): v for k, v in info["regions"].items()}
            name = self._agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name  # notifications use str
            self._names[p], self._rank_of[name], self._remote[p] = name, p, info
        dist.barrier(group=group)  # every rank has read every key it needs
        with contextlib.suppress(Exception):
            store.delete_key(str(self.rank))

    def close(self) -> None:
        """Release transfers, forget peers, deregister, drop the agent; idempotent."""
        agent, self._agent = self._agent, None
        if agent is None:
            return
        for _, handle in self._writes:
            with contextlib.suppress(Exception):
                agent.release_xfer_handle(handle)
        self._writes = []
        for descs in self._in_place:
            with contextlib.suppress(Exception):
                agent.deregister_memory(descs)
        self._in_place = []
        for name in self._names.values():
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(name)
        if self._registered is not None:
            with contextlib.suppress(Exception):
                agent.deregister_memory(self._registered)
            self._registered = None
        self._pool = None
        del agent  # the agent (UCX worker, endpoints) ends with its last reference

    @property
    def closed(self) -> bool:
        return self._agent is None

    # ---- the protocol -------------------------------------------------------
    def _poll(self) -> bool:
        """Take new notifications; True if there were any."""
        got = False
        for name, notes in self._agent.get_new_notifs().items():
            peer = self._rank_of.get(name)
            if peer is None:
                continue
            for note in notes:
                kind, seq, nbytes = _NOTE.unpack(note)
                if kind == _DATA:
                    self._arrived[peer][seq] = nbytes
                elif kind == _ACK:
                    self._acked[peer].add(seq)
                got = got or kind != _PING  # a ping is no progress
        return got

    def _check_writes(self) -> bool:
        """Release completed writes; True when none is left. A failed one names its peer."""
        left = []
        for peer, handle in self._writes:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as exc:
                raise PeerError(peer, f"NIXL write failed ({exc}); did it exit?") from exc
            if state == "ERR":
                raise PeerError(peer, "NIXL write failed; did it exit?")
            if state == "DONE":
                self._agent.release_xfer_handle(handle)
            else:
                left.append((peer, handle))
        self._writes = left
        return not left

    def _wait(self, ready: Callable[[], bool], peer: int | None, what: str) -> None:
        """Poll until ``ready()``; `PeerError` naming ``peer`` (None: the first pending
        write's) after ``timeout`` seconds without any notification."""
        last = time.monotonic()
        ping = last + _PING_AFTER_S
        sleep = 0.0
        while not ready():
            progressed = self._poll()
            if self._writes:
                self._check_writes()
            if ready():
                return
            now = time.monotonic()
            who = peer if peer is not None else self._writes[0][0]
            if progressed:
                last, ping, sleep = now, now + _PING_AFTER_S, 0.0
            elif now - last > self._timeout:
                silent = f"sent nothing for {self._timeout:.1f} s"
                raise PeerError(who, f"{silent} while {what} (stalled or gone)")
            elif now > ping:
                self._ping(who)
                ping = now + _PING_AFTER_S
            time.sleep(sleep)  # releases the GIL; 0 is a yield
            sleep = min(_MAX_SLEEP_S, sleep * 2 or 0.00002)

    def _ping(self, peer: int) -> None:
        """A notification to a silent peer: UCX fails it at once if the peer is gone."""
        try:
            self._agent.send_notif(self._names[peer], _NOTE.pack(_PING, 0, 0))
        except Exception as exc:
            raise PeerError(peer, f"disconnected ({type(exc).__name__}); did it exit?") from None

    def _slot(self, owner_region: int, seq: int) -> int:
        return owner_region + (seq % self._slots) * self._chunk

    def post(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> list[Transfer]:
        """Start a round: stage and write the sends; pass the result to `complete`."""
        groups: dict[tuple[int, int, int], list[int]] = {}
        sources: dict[tuple[int, int, int], Tensor] = {}
        for peer, src in sends:
            if peer not in self._send_seq:
                raise ValueError(f"rank {peer} is not a NIXL peer of rank {self.rank}")
            if src.numel() > self._chunk:
                raise ValueError(f"chunk of {src.numel()} bytes > chunk_bytes {self._chunk}")
            key = (id(src), src.data_ptr(), src.numel())
            groups.setdefault(key, []).append(peer)
            sources[key] = src
        per_peer = [p for readers in groups.values() for p in readers]
        if max([per_peer.count(p) for p in per_peer] + [0]) > self._slots:
            # The extra message would wait for an ACK sent only after this round.
            raise ValueError(f"a round may send at most {self._slots} messages per peer")
        if len(groups) > len(self.peers):
            raise ValueError(f"a round may send at most {len(self.peers)} distinct chunks")
        staged, earlier = [], dict.fromkeys(self.peers, 0)
        for i, (key, readers) in enumerate(groups.items()):
            for p in readers:
                seq = self._send_seq[p] + earlier[p]
                earlier[p] += 1
                self._wait(lambda p=p, s=seq: self._slot_free(p, s), p, "its slot was busy")
            src = sources[key]
            if not src.is_cuda and src.numel():
                # Host memory is written from where it is, registered for this round
                # (~10-40 us here, a copy of a large chunk costs far more).
                self._in_place.append(
                    self._agent.register_memory([(src.data_ptr(), src.numel(), 0, "")], "DRAM")
                )
                staged.append((src, readers))
                continue
            stage = self._send_region[i * self._chunk : i * self._chunk + src.numel()]
            self._copier.copy(stage, src)
            staged.append((stage, readers))
        self._copier.fence()  # the chunk is in the send slot before it is written out
        for stage, readers in staged:
            for p in readers:
                self._write(p, stage)
        return list(recvs)

    def _slot_free(self, peer: int, seq: int) -> bool:
        return seq < self._slots or (seq - self._slots) in self._acked[peer]

    def _write(self, peer: int, stage: Tensor) -> None:
        seq, n = self._send_seq[peer], stage.numel()
        self._send_seq[peer] += 1
        self._acked[peer].discard(seq - self._slots)
        note = _NOTE.pack(_DATA, seq, n)
        if n == 0:
            self._agent.send_notif(self._names[peer], note)
            return
        info, agent = self._remote[peer], self._agent
        where = info["addr"] + self._slot(info["regions"][self.rank], seq)
        local = agent.get_xfer_descs(
            [(stage.data_ptr(), n, max(stage.get_device(), 0))], "VRAM" if stage.is_cuda else "DRAM"
        )
        remote = agent.get_xfer_descs([(where, n, info["device"])], info["mem"])
        try:
            handle = agent.initialize_xfer("WRITE", local, remote, self._names[peer], note)
            state = agent.transfer(handle)
        except Exception as exc:
            raise PeerError(peer, f"NIXL write could not start ({exc}); did it exit?") from exc
        if state == "ERR":
            raise PeerError(peer, "NIXL write failed at once; did it exit?")
        self._writes.append((peer, handle))

    def complete(self, recvs: Sequence[Transfer]) -> None:
        """Finish a round started by `post`: receive, wait for own writes, acknowledge."""
        acks = []
        for peer, dst in recvs:
            seq = self._recv_seq[peer]
            arrived = self._arrived[peer]
            self._wait(lambda a=arrived, s=seq: s in a, peer, f"waiting for chunk {seq}")
            nbytes = self._arrived[peer].pop(seq)
            if nbytes != dst.numel():
                raise PeerError(
                    peer,
                    f"message {seq} of {nbytes} bytes, expected {dst.numel()} bytes"
                    " (ranks disagree on the collective's sizes)",
                )
            self._recv_seq[peer] += 1
            at = self._slot(self._remote_region(peer), seq)
            self._copier.copy(dst, self._recv_region[at : at + nbytes])
            acks.append((peer, seq))
        if self._writes:
            self._wait(self._check_writes, None, "a write to it was in flight")
        self._release_in_place()
        self._copier.fence()  # the data left the slots before they are released
        for peer, seq in acks:
            with contextlib.suppress(Exception):  # a peer that got everything may have closed
                self._agent.send_notif(self._names[peer], _NOTE.pack(_ACK, seq, 0))

    def _release_in_place(self) -> None:
        for descs in self._in_place:
            self._agent.deregister_memory(descs)
        self._in_place = []

    def _remote_region(self, peer: int) -> int:
        """Offset of ``peer``'s slots in this rank's receive region."""
        return self.peers.index(peer) * self._slots * self._chunk

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        self.complete(self.post(sends, recvs))
