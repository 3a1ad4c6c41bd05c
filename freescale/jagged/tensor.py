"""Jagged containers: one feature (`JaggedTensor`) or several sharing offsets."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise

import torch
from torch import Tensor

from freescale.jagged import ops


@dataclass
class JaggedTensor:
    """``values`` (first dim = total length) + int64 ``offsets`` of ``B + 1`` entries."""

    values: Tensor
    offsets: Tensor

    def __post_init__(self) -> None:
        if self.offsets.dim() != 1 or self.offsets.dtype != torch.int64:
            raise ValueError("JaggedTensor offsets must be a 1-D int64 tensor")
        if self.values.dim() < 1:
            raise ValueError("JaggedTensor values must have at least one dimension")

    @classmethod
    def from_lengths(cls, values: Tensor, lengths: Tensor) -> JaggedTensor:
        return cls(values, ops.lengths_to_offsets(lengths.to(values.device)))

    @property
    def num_segments(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> Tensor:
        return ops.offsets_to_lengths(self.offsets)

    def select(self, indices: Tensor, total: int | None = None) -> JaggedTensor:
        positions, offsets = ops.gather_positions(self.offsets, indices, total)
        return JaggedTensor(self.values[positions], offsets)

    def validate(self, what: str = "jagged tensor") -> None:
        ops.check_offsets(self.offsets, self.values.shape[0], what)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> JaggedTensor:
        return JaggedTensor(
            self.values.to(device, non_blocking=non_blocking),
            self.offsets.to(device, non_blocking=non_blocking),
        )

    def equal(self, other: JaggedTensor) -> bool:
        return _same(self.values, other.values) and _same(self.offsets, other.offsets)

    def segments(self) -> list[Tensor]:
        """Per-segment views (for tests and debugging; loops on the host)."""
        bounds = self.offsets.tolist()
        return [self.values[a:b] for a, b in pairwise(bounds)]


@dataclass
class JaggedFeatures:
    """Several named features with equal per-segment lengths, sharing one offsets.

    UIH item ids, action types and timestamps of a batch are one of these.
    """

    offsets: Tensor
    features: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.offsets.dim() != 1 or self.offsets.dtype != torch.int64:
            raise ValueError("JaggedFeatures offsets must be a 1-D int64 tensor")
        sizes = {name: t.shape[0] for name, t in self.features.items() if t.dim() >= 1}
        # Compared, not hashed: under `torch.export` the sizes are symbolic.
        first = next(iter(sizes.values()), None)
        if any(s != first for s in sizes.values()) or len(sizes) != len(self.features):
            raise ValueError(f"features sharing offsets must have equal first dims, got {sizes}")

    @property
    def num_segments(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> Tensor:
        return ops.offsets_to_lengths(self.offsets)

    def __getitem__(self, name: str) -> Tensor:
        return self.features[name]

    def jagged(self, name: str) -> JaggedTensor:
        return JaggedTensor(self.features[name], self.offsets)

    def select_with_positions(
        self, indices: Tensor, total: int | None = None
    ) -> tuple[JaggedFeatures, Tensor]:
        positions, offsets = ops.gather_positions(self.offsets, indices, total)
        feats = {name: t[positions] for name, t in self.features.items()}
        return JaggedFeatures(offsets, feats), positions

    def select(self, indices: Tensor, total: int | None = None) -> JaggedFeatures:
        return self.select_with_positions(indices, total)[0]

    def slice(self, start: int, stop: int) -> JaggedFeatures:
        """Segments ``[start, stop)`` as views (contiguous range, no gather)."""
        lo, hi = int(self.offsets[start]), int(self.offsets[stop])
        feats = {name: t[lo:hi] for name, t in self.features.items()}
        return JaggedFeatures(self.offsets[start : stop + 1] - lo, feats)

    @staticmethod
    def concat(parts: list[JaggedFeatures]) -> JaggedFeatures:
        if not parts:
            raise ValueError("cannot concatenate zero JaggedFeatures")
        names = list(parts[0].features)
        for p in parts[1:]:
            if list(p.features) != names:
                raise ValueError(f"feature names differ: {names} vs {list(p.features)}")
        offsets = ops.concat_offsets([p.offsets for p in parts])
        feats = {n: torch.cat([p.features[n] for p in parts]) for n in names}
        return JaggedFeatures(offsets, feats)

    def validate(self, what: str) -> None:
        total = next(iter(self.features.values())).shape[0] if self.features else None
        if total is None:
            total = int(self.offsets[-1]) if self.offsets.numel() else 0
        ops.check_offsets(self.offsets, total, what)

    def tensors(self) -> Iterator[Tensor]:
        yield self.offsets
        yield from self.features.values()

    def map(self, fn) -> JaggedFeatures:
        return JaggedFeatures(fn(self.offsets), {n: fn(t) for n, t in self.features.items()})

    def equal(self, other: JaggedFeatures) -> bool:
        if list(self.features) != list(other.features):
            return False
        if not _same(self.offsets, other.offsets):
            return False
        return all(_same(t, other.features[n]) for n, t in self.features.items())


def _same(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
