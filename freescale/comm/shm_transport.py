"""`ShmTransport`: the SM-free rounds through shared memory between the processes of one host.

Data moves through shared memory, notifications through Unix sockets.

Segments. Every rank owns one file in ``/dev/shm``, reserved with
``posix_fallocate`` (a too-small ``/dev/shm`` fails at setup with a clear
error, not with SIGBUS later), mapped by itself and by every other rank of
its host with ``torch.from_file(shared=True)``, and unlinked as soon as all of
them have mapped it: nothing is left behind even if a process is killed.
On a GPU every mapping is page-locked with ``cudaHostRegister``, so the
sender's D2H writes straight into its segment and the receiver's H2D reads
straight out of it: the only copies are the two DMA transfers.

Layout of rank s's segment: ``slots_per_peer`` slots of ``chunk_bytes`` for
each other local rank, then ``slots_per_peer`` broadcast slots (one chunk sent
to several peers in one round, as AllGather does, is written once).

Synchronization protocol (per ordered pair s -> d, over one stream socket per
pair; messages are 32 bytes ``kind, seq, offset, nbytes``):

1. s waits until the slot it will write is free: every reader of the slot's
   previous message has sent ``ACK(offset)``.
2. s copies the chunk into the slot and fences (the D2H is complete).
3. s sends ``DATA(seq, offset, nbytes)``; ``seq`` counts s's messages to d.
4. d, expecting its next message from s, reads ``DATA``, checks ``seq`` and
   ``nbytes`` against what it expects, copies ``nbytes`` at ``offset`` of s's
   segment into its destination and fences (the H2D is complete).
5. d sends ``ACK(offset)``: the slot may be overwritten. (An ACK that cannot
   be sent because s has closed is dropped: s needed nothing more from d.)

The socket write/read pair orders the data write before the data read (the
kernel's locking is a full memory barrier), so no atomics are needed in
Python. Waiting is a blocking ``recv`` (GIL released, no busy polling) with a
timeout: a peer that exited shows up as end-of-file at once, a stalled one
after ``timeout`` seconds, both as `PeerError` naming it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import uuid
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from freescale.comm.transport import Copier, PeerError, Transfer, register_host, unregister_host

_MSG = struct.Struct("<qqqq")  # kind, seq, offset, nbytes
_DATA, _ACK = 1, 2
SHM_DIR = "/dev/shm"


class ShmTransport:
    """Pairwise rounds through shared memory among ``local_ranks`` (this host's ranks).

    Construction is collective over ``group`` (a gloo group of *all* ranks:
    every rank calls it, also ranks of other hosts, which only take part in
    the barriers).
    """

    name = "shm"

    def __init__(
        self,
        group: Any,
        local_ranks: Sequence[int],
        copier: Copier,
        chunk_bytes: int,
        timeout: float,
        slots_per_peer: int = 2,
    ) -> None:
        if chunk_bytes < 1 or slots_per_peer < 1:
            raise ValueError("chunk_bytes and slots_per_peer must be >= 1")
        self.rank = dist.get_rank(group)
        self.local = sorted(local_ranks)
        if self.rank not in self.local:
            raise ValueError(f"rank {self.rank} is not among its local ranks {self.local}")
        self._copier, self._chunk, self._slots = copier, chunk_bytes, slots_per_peer
        self._timeout = timeout
        self._in_use: dict[int, set[int]] = {}  # my slot offset -> readers yet to ACK
        self._send_seq = {p: 0 for p in self.local}
        self._recv_seq = {p: 0 for p in self.local}
        self._data: dict[int, deque[tuple[int, int, int]]] = {p: deque() for p in self.local}
        self._bcast = 0  # broadcast messages so far
        self._segments: dict[int, Tensor] = {}
        self._registered: list[Tensor] = []
        self._socks: dict[int, socket.socket] = {}
        self._path = ""
        self._setup(group)

    @property
    def chunk_bytes(self) -> int:
        return self._chunk

    def _peer_index(self, owner: int, reader: int) -> int:
        return [p for p in self.local if p != owner].index(reader)

    def _slot_offset(self, owner: int, reader: int | None, k: int) -> int:
        """Byte offset in ``owner``'s segment of slot ``k`` for ``reader`` (None: broadcast)."""
        n_peers = len(self.local) - 1
        region = n_peers if reader is None else self._peer_index(owner, reader)
        return (region * self._slots + k % self._slots) * self._chunk

    # ---- setup and teardown -------------------------------------------------
    def _setup(self, group: Any) -> None:
        token = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(token, group=group, group_src=0)
        base = f"freescale-smfree-{token[0]}"
        nbytes = len(self.local) * self._slots * self._chunk
        self._path = os.path.join(SHM_DIR, f"{base}-{self.rank}")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._segments[self.rank] = _create_segment(self._path, nbytes)
            listener.bind(f"\0{base}-{self.rank}")
            listener.listen(len(self.local))
            listener.settimeout(self._timeout)
            dist.barrier(group=group)  # every segment and listener exists
            for p in self.local:
                if p != self.rank:
                    self._segments[p] = _open_segment(os.path.join(SHM_DIR, f"{base}-{p}"), p)
            self._connect(base, listener)
            dist.barrier(group=group)  # every segment is mapped by all its readers
        finally:
            listener.close()
            _unlink(self._path)
        if self._copier.cuda:
            for seg in self._segments.values():
                if register_host(seg):
                    self._registered.append(seg)

    def _connect(self, base: str, listener: socket.socket) -> None:
        for p in self.local:
            if p < self.rank:  # the higher rank connects, the lower accepts
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(self._timeout)
                s.connect(f"\0{base}-{p}")
                s.sendall(struct.pack("<q", self.rank))
                self._socks[p] = s
        for _ in [p for p in self.local if p > self.rank]:
            try:
                s, _addr = listener.accept()
            except TimeoutError:
                missing = [p for p in self.local if p > self.rank and p not in self._socks]
                raise PeerError(missing[0], "never connected to the shm transport") from None
            s.settimeout(self._timeout)
            (peer,) = struct.unpack("<q", _recv_exact(s, 8, -1))
            self._socks[peer] = s

    def close(self) -> None:
        for seg in self._registered:
            with contextlib.suppress(Exception):  # at interpreter exit CUDA may be gone
                unregister_host(seg)
        self._registered.clear()
        for s in self._socks.values():
            s.close()
        self._socks.clear()
        self._segments.clear()  # unmaps: the files were unlinked at setup
        if self._path:
            _unlink(self._path)

    # ---- the protocol -------------------------------------------------------
    def _pump(self, peer: int) -> None:
        """Read one message from ``peer``: an ACK frees a slot, DATA is queued."""
        kind, seq, offset, nbytes = _MSG.unpack(_recv_exact(self._socks[peer], _MSG.size, peer))
        if kind == _ACK:
            self._in_use.get(offset, set()).discard(peer)
        elif kind == _DATA:
            self._data[peer].append((seq, offset, nbytes))
        else:
            raise PeerError(peer, f"sent an unknown message kind {kind}")

    def _send(self, peer: int, kind: int, seq: int, offset: int, nbytes: int) -> None:
        try:
            self._socks[peer].sendall(_MSG.pack(kind, seq, offset, nbytes))
        except OSError as exc:
            if kind == _ACK:
                # A peer that got all it needed may close before our last ACKs:
                # it no longer needs them. (A crashed peer is reported by the
                # next wait for its data, which reads end-of-file.)
                return
            raise PeerError(peer, f"connection lost ({exc}); did it exit?") from exc

    def _claim(self, offset: int, readers: list[int]) -> None:
        while self._in_use.get(offset):
            self._pump(next(iter(self._in_use[offset])))
        self._in_use[offset] = set(readers)

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None:
        # Group sends of one source tensor (a broadcast) so it is written once.
        groups: dict[tuple[int, int, int], list[Transfer]] = {}
        for peer, src in sends:
            if peer not in self._socks:
                raise ValueError(f"rank {peer} is not a local peer of rank {self.rank}")
            if src.numel() > self._chunk:
                raise ValueError(f"chunk of {src.numel()} bytes > chunk_bytes {self._chunk}")
            groups.setdefault((id(src), src.data_ptr(), src.numel()), []).append((peer, src))
        regions = ["broadcast" if len(g) > 1 else g[0][0] for g in groups.values()]
        if max([regions.count(r) for r in regions] + [0]) > self._slots:
            # More messages than slots in one region within one round would wait
            # for ACKs that peers only send after this round: a deadlock.
            raise ValueError(f"a round may send at most {self._slots} messages per slot region")
        notes = []
        for group in groups.values():
            src, readers = group[0][1], [p for p, _ in group]
            if len(readers) > 1:
                offset = self._slot_offset(self.rank, None, self._bcast)
                self._bcast += 1
            else:
                offset = self._slot_offset(self.rank, readers[0], self._send_seq[readers[0]])
            self._claim(offset, readers)
            seg = self._segments[self.rank]
            self._copier.copy(seg[offset : offset + src.numel()], src)
            notes += [(p, offset, src.numel()) for p in readers]
        self._copier.fence()  # the data is in the segment before anyone is told
        for peer, offset, nbytes in notes:
            self._send(peer, _DATA, self._send_seq[peer], offset, nbytes)
            self._send_seq[peer] += 1
        acks = []
        for peer, dst in recvs:
            while not self._data[peer]:
                self._pump(peer)
            seq, offset, nbytes = self._data[peer].popleft()
            if seq != self._recv_seq[peer] or nbytes != dst.numel():
                raise PeerError(
                    peer,
                    f"message {seq} of {nbytes} bytes, expected message {self._recv_seq[peer]}"
                    f" of {dst.numel()} bytes (ranks disagree on the collective's sizes)",
                )
            self._recv_seq[peer] += 1
            self._copier.copy(dst, self._segments[peer][offset : offset + nbytes])
            acks.append((peer, offset))
        self._copier.fence()  # the data left the peer's slots before they are released
        for peer, offset in acks:
            self._send(peer, _ACK, 0, offset, 0)


def _recv_exact(sock: socket.socket, n: int, peer: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        try:
            part = sock.recv(n - len(buf))
        except TimeoutError:
            raise PeerError(
                peer, f"sent nothing for {sock.gettimeout():.1f} s (stalled, or not calling)"
            ) from None
        except OSError as exc:
            raise PeerError(peer, f"connection lost ({exc}); did it exit?") from exc
        if not part:
            raise PeerError(peer, "closed its connection (exited or crashed)")
        buf += part
    return bytes(buf)


def _create_segment(path: str, nbytes: int) -> Tensor:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        _unlink(path)
        raise RuntimeError(
            f"cannot reserve {nbytes} bytes in {SHM_DIR} ({exc}); lower pool_bytes or use"
            " the gloo transport"
        ) from exc
    finally:
        os.close(fd)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _open_segment(path: str, peer: int) -> Tensor:
    try:
        nbytes = os.path.getsize(path)
    except FileNotFoundError:
        raise PeerError(
            peer, f"its shared memory {path} is not visible here: not on this host?"
        ) from None
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
