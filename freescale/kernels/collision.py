"""Collision split of two consecutive steps' row sets on one shard (the rows prioritized
embedding updates must wait for).

Inputs: ``rows_now`` = I^i and ``rows_next`` = I^(i+1), the rows one shard
serves in step i and step i+1, each **sorted ascending without duplicates**
(what ``torch.unique`` returns) and of the same integer dtype.

`collision_split` returns, without any host sync, two int64 maps:

- ``now_to_next[k]``: position of ``rows_now[k]`` in ``rows_next``, -1 if absent;
- ``next_to_now[k]``: position of ``rows_next[k]`` in ``rows_now``, -1 if absent.

From them, `CollisionSplit` gives the index sets as ascending positions (so
the rows they pick are sorted):

- ``collision()`` -> ``(c_now, c_next)``: C = I^i ∩ I^(i+1), aligned:
  ``rows_now[c_now] == rows_next[c_next]``;
- ``exclusive_now()``: X = I^i \\ I^(i+1), positions into ``rows_now``;
- ``exclusive_next()``: N = I^(i+1) \\ I^i, positions into ``rows_next``.

Compacting reads one count back per set (``torch.nonzero``): the number of
collisions depends on the data, so no caller can pass it in advance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from freescale.kernels.backend import choose_impl, triton_module


@dataclass(frozen=True)
class CollisionSplit:
    rows_now: Tensor
    rows_next: Tensor
    now_to_next: Tensor  # [len(rows_now)] int64, -1 = exclusive now
    next_to_now: Tensor  # [len(rows_next)] int64, -1 = exclusive next

    def collision(self) -> tuple[Tensor, Tensor]:
        """Positions of C in ``rows_now`` and in ``rows_next`` (aligned, ascending)."""
        c_now = torch.nonzero(self.now_to_next >= 0).squeeze(1)
        return c_now, self.now_to_next[c_now]

    def exclusive_now(self) -> Tensor:
        """Positions of X in ``rows_now`` (ascending)."""
        return torch.nonzero(self.now_to_next < 0).squeeze(1)

    def exclusive_next(self) -> Tensor:
        """Positions of N in ``rows_next`` (ascending)."""
        return torch.nonzero(self.next_to_now < 0).squeeze(1)

    def collision_rows(self) -> Tensor:
        return self.rows_now[self.collision()[0]]

    def exclusive_now_rows(self) -> Tensor:
        return self.rows_now[self.exclusive_now()]

    def exclusive_next_rows(self) -> Tensor:
        return self.rows_next[self.exclusive_next()]


def collision_split(
    rows_now: Tensor, rows_next: Tensor, *, impl: str | None = None
) -> CollisionSplit:
    """Collision and exclusive sets of two sorted unique row sets (see module doc)."""
    _check(rows_now, rows_next)
    path = choose_impl(impl, rows_now.device)
    if path == "torch":
        return collision_split_reference(rows_now, rows_next)
    if path == "eager":
        return collision_split_eager(rows_now, rows_next)
    return triton_module("collision").collision_split_triton(rows_now, rows_next)


def collision_split_reference(rows_now: Tensor, rows_next: Tensor) -> CollisionSplit:
    """Vectorized torch: ``searchsorted`` both ways."""
    return CollisionSplit(
        rows_now, rows_next, positions_in(rows_now, rows_next), positions_in(rows_next, rows_now)
    )


def positions_in(needles: Tensor, hay: Tensor) -> Tensor:
    """Position of each needle in the sorted unique ``hay``, -1 where absent."""
    if hay.numel() == 0:
        return torch.full(needles.shape, -1, dtype=torch.int64, device=needles.device)
    pos = torch.searchsorted(hay, needles).clamp_(max=hay.numel() - 1)
    return torch.where(hay[pos] == needles, pos, -1)


def collision_split_eager(rows_now: Tensor, rows_next: Tensor) -> CollisionSplit:
    """Python dictionaries over the rows (the per-row loop baseline)."""
    now, nxt = rows_now.tolist(), rows_next.tolist()
    where_now = {r: k for k, r in enumerate(now)}
    where_next = {r: k for k, r in enumerate(nxt)}

    def as_tensor(values: list[int]) -> Tensor:
        return torch.tensor(values, dtype=torch.int64).to(rows_now.device)

    return CollisionSplit(
        rows_now,
        rows_next,
        as_tensor([where_next.get(r, -1) for r in now]),
        as_tensor([where_now.get(r, -1) for r in nxt]),
    )


def collision_bytes(num_now: int, num_next: int, id_bytes: int) -> int:
    """Both row sets read once, both int64 maps written once (searches not counted)."""
    return (num_now + num_next) * (id_bytes + 8)


def _check(rows_now: Tensor, rows_next: Tensor) -> None:
    for name, t in (("rows_now", rows_now), ("rows_next", rows_next)):
        if t.dim() != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {t.dtype} {tuple(t.shape)}")
    if rows_now.dtype != rows_next.dtype:
        raise ValueError(f"row sets differ in dtype: {rows_now.dtype} vs {rows_next.dtype}")
