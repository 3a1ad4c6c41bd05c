"""Jagged index kernels (layer 1): each op has a vectorized torch reference
(the CPU path), an eager per-sample/per-rank loop (the paper's baseline) and a
Triton kernel (the CUDA path); the public functions below choose by device,
and ``impl=`` or ``FREESCALE_KERNELS`` force a path. Importing this package
does not import Triton.
"""

from freescale.kernels.backend import IMPL_ENV, choose_impl
from freescale.kernels.collision import CollisionSplit, collision_split
from freescale.kernels.combine import gather_rows, ranged_combine
from freescale.kernels.dispatch import (
    DispatchPlan,
    apply_dispatch,
    ranged_dispatch,
    ranged_dispatch_ids,
)
from freescale.kernels.permute import indexed_permute
from freescale.kernels.shard import RowSharding, bucketize_by_shard
from freescale.kernels.transpose import keyed_transpose, to_batch_major, to_feature_major

__all__ = [
    "IMPL_ENV",
    "CollisionSplit",
    "DispatchPlan",
    "RowSharding",
    "apply_dispatch",
    "bucketize_by_shard",
    "choose_impl",
    "collision_split",
    "gather_rows",
    "indexed_permute",
    "keyed_transpose",
    "ranged_combine",
    "ranged_dispatch",
    "ranged_dispatch_ids",
    "to_batch_major",
    "to_feature_major",
]
