"""Indexed permute: reorder (or select) the segments of jagged features.

The balancer all-gathers the samples of a step and every rank keeps the ones
the partition plan gives it, in plan order: output segment ``i`` is input
segment ``indices[i]`` (any order, repeats allowed), for every feature that
shares the offsets (item ids, actions, timestamps, ...).

Three implementations with identical results: `indexed_permute_reference`
(vectorized torch, the CPU path), `indexed_permute_eager` (one slice per
sample, then concatenate: the paper's baseline) and the Triton kernel in
`freescale.kernels.triton_permute`.
"""

from __future__ import annotations

from typing import TypeVar

import torch
from torch import Tensor

from freescale.jagged import ops
from freescale.jagged.tensor import JaggedFeatures, JaggedTensor
from freescale.kernels.backend import choose_impl, triton_module

J = TypeVar("J", JaggedTensor, JaggedFeatures)

_VALUES = "values"


def as_features(jagged: JaggedTensor | JaggedFeatures) -> JaggedFeatures:
    """A `JaggedTensor` seen as one-feature `JaggedFeatures` (no copy)."""
    if isinstance(jagged, JaggedTensor):
        return JaggedFeatures(jagged.offsets, {_VALUES: jagged.values})
    return jagged


def like(template: J, out: JaggedFeatures) -> J:
    """Return ``out`` in the type of ``template`` (inverse of `as_features`)."""
    if isinstance(template, JaggedTensor):
        return JaggedTensor(out.features[_VALUES], out.offsets)  # type: ignore[return-value]
    return out  # type: ignore[return-value]


def indexed_permute(
    jagged: J, indices: Tensor, total: int | None = None, *, impl: str | None = None
) -> J:
    """Segments ``indices`` of ``jagged`` (all features), in that order.

    ``total`` is the number of output values (sum of the selected lengths); a
    caller that knows it (the balancer does, from the all-gathered lengths)
    passes it so that no device value is read back on the host.
    """
    feats = as_features(jagged)
    path = choose_impl(impl, feats.offsets.device)
    if path == "torch":
        out = indexed_permute_reference(feats, indices, total)
    elif path == "eager":
        out = indexed_permute_eager(feats, indices)
    else:
        out = triton_module("permute").indexed_permute_triton(feats, indices, total)
    return like(jagged, out)


def indexed_permute_reference(
    feats: JaggedFeatures, indices: Tensor, total: int | None = None
) -> JaggedFeatures:
    """Vectorized torch: one position per output value, then one gather per feature."""
    positions, offsets = ops.gather_positions(feats.offsets, indices, total)
    return JaggedFeatures(offsets, {n: t[positions] for n, t in feats.features.items()})


def indexed_permute_eager(feats: JaggedFeatures, indices: Tensor) -> JaggedFeatures:
    """One slice per selected sample and feature, then concatenate (the baseline)."""
    bounds = feats.offsets.tolist()
    lengths: list[int] = []
    pieces: dict[str, list[Tensor]] = {n: [] for n in feats.features}
    for i in indices.tolist():
        lo, hi = bounds[i], bounds[i + 1]
        lengths.append(hi - lo)
        for name, t in feats.features.items():
            pieces[name].append(t[lo:hi])
    out = {n: torch.cat(pieces[n]) if lengths else t[:0].clone() for n, t in feats.features.items()}
    offsets = ops.lengths_to_offsets(torch.tensor(lengths, dtype=torch.int64))
    return JaggedFeatures(offsets.to(feats.offsets.device), out)


def row_bytes(t: Tensor) -> int:
    """Bytes of one row (one entry of the first dim) of ``t``."""
    width = 1
    for size in t.shape[1:]:
        width *= size
    return width * t.element_size()


def permute_bytes(feats: JaggedFeatures, num_segments: int, total: int) -> int:
    """Minimum bytes an indexed permute moves: every selected value read and
    written once, plus the offsets/indices it reads and the offsets it writes."""
    values = sum(2 * total * row_bytes(t) for t in feats.features.values())
    return values + 8 * (4 * num_segments + 1)
