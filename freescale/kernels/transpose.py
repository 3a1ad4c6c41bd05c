"""Keyed transpose: feature-major <-> batch-major jagged layout.

TorchRec's `KeyedJaggedTensor` stores ``K`` features x ``B`` samples
feature-major: segment ``k * B + b`` holds feature ``k`` of sample ``b``
(lengths ``[K * B]``). Batch-major interleaves per sample: segment
``b * K + k``. Both are a row-major grid of segments; transposing the grid
(``[rows, cols]`` -> ``[cols, rows]``) converts one into the other. The number
of values never changes, so the output size is known without a read-back.
"""

from __future__ import annotations

import torch

from freescale.jagged.tensor import JaggedFeatures, JaggedTensor
from freescale.kernels.backend import choose_impl, triton_module
from freescale.kernels.permute import (
    J,
    as_features,
    indexed_permute_eager,
    indexed_permute_reference,
    like,
)


def keyed_transpose(jagged: J, rows: int, cols: int, *, impl: str | None = None) -> J:
    """Segments of a row-major ``[rows, cols]`` grid laid out as ``[cols, rows]``."""
    feats = as_features(jagged)
    if rows < 0 or cols < 0 or feats.num_segments != rows * cols:
        raise ValueError(f"{feats.num_segments} segments do not form a {rows} x {cols} grid")
    path = choose_impl(impl, feats.offsets.device)
    if path == "torch":
        out = keyed_transpose_reference(feats, rows, cols)
    elif path == "eager":
        out = keyed_transpose_eager(feats, rows, cols)
    else:
        out = triton_module("permute").keyed_transpose_triton(feats, rows, cols)
    return like(jagged, out)


def to_batch_major(jagged: J, num_keys: int, *, impl: str | None = None) -> J:
    """Feature-major (segment ``k * B + b``) to batch-major (segment ``b * K + k``)."""
    return keyed_transpose(jagged, num_keys, _batch(jagged, num_keys), impl=impl)


def to_feature_major(jagged: J, num_keys: int, *, impl: str | None = None) -> J:
    """Batch-major (segment ``b * K + k``) to feature-major (segment ``k * B + b``)."""
    return keyed_transpose(jagged, _batch(jagged, num_keys), num_keys, impl=impl)


def transpose_indices(rows: int, cols: int, device: torch.device | None = None) -> torch.Tensor:
    """Input segment of every output segment of the grid transpose."""
    return torch.arange(rows * cols, device=device).view(rows, cols).t().reshape(-1)


def keyed_transpose_reference(feats: JaggedFeatures, rows: int, cols: int) -> JaggedFeatures:
    """An indexed permute by `transpose_indices`; the total is the input's."""
    total = _total(feats)
    return indexed_permute_reference(
        feats, transpose_indices(rows, cols, feats.offsets.device), total
    )


def keyed_transpose_eager(feats: JaggedFeatures, rows: int, cols: int) -> JaggedFeatures:
    """One slice per (sample, feature) segment, then concatenate."""
    return indexed_permute_eager(feats, transpose_indices(rows, cols, feats.offsets.device))


def _total(feats: JaggedFeatures) -> int:
    first = next(iter(feats.features.values()), None)
    return first.shape[0] if first is not None else int(feats.offsets[-1])


def _batch(jagged: JaggedTensor | JaggedFeatures, num_keys: int) -> int:
    n = jagged.num_segments
    if num_keys <= 0 or n % num_keys:
        raise ValueError(f"{n} segments are not a multiple of num_keys={num_keys}")
    return n // num_keys
