"""Short strings between the ranks of a gloo group, as byte tensors.

`torch.distributed`'s object collectives pickle; these send UTF-8 bytes, so
what one rank sends can never be code to another. Used by checkpoints: rank 0
announces the files to hash, each rank reports its digests or the problem it
found, and every rank takes the same decision. Without a process group
(``world == 1``) they return at once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def broadcast_text(text: str, group: Any, world: int, src: int = 0) -> str:
    """``text`` of rank ``src`` (the argument is ignored on other ranks)."""
    if world == 1:
        return text
    size = torch.tensor([len(text.encode())], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)  # src's length
    buf = _bytes(text, int(size.item()))  # on src: its text; elsewhere overwritten
    if buf.numel():
        dist.broadcast(buf, src=src, group=group)
    return bytes(buf.numpy()).decode()


def all_gather_text(text: str, group: Any, world: int) -> list[str]:
    """Every rank's ``text``, in rank order."""
    if world == 1:
        return [text]
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([len(text.encode())], dtype=torch.int64), group=group)
    longest = max(int(s.item()) for s in sizes)
    if longest == 0:
        return [""] * world
    padded = _bytes(text, longest)
    parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [bytes(p[: int(s.item())].numpy()).decode() for p, s in zip(parts, sizes, strict=True)]


def first_problem(problem: str, group: Any, world: int) -> str:
    """The first non-empty ``problem`` in rank order ('' if none): one verdict for all."""
    return next((p for p in all_gather_text(problem, group, world) if p), "")


def _bytes(text: str, size: int | None = None) -> torch.Tensor:
    """``text`` as UTF-8 in a uint8 tensor of ``size`` bytes (cut or zero-padded)."""
    raw = text.encode()
    size = len(raw) if size is None else size
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(raw[:size].ljust(size, b"\0")), dtype=torch.uint8)
