"""Candidate -> history cross-attention on packed jagged rows: the plan, the torch twin, dispatch.

Sample ``i`` has ``N_i`` query rows (its candidates, ``q_offsets``) and
``L_i`` key/value rows (its history, ``k_offsets``). Every query of sample
``i`` attends, with a softmax over the keys, to all ``L_i`` keys of its own
sample and to nothing else: not to other candidates, not to itself. A query
whose sample has no keys gets output 0 (and gradient 0). Scores are scaled by
``1 / sqrt(head_dim)``, as `torch.nn.functional.scaled_dot_product_attention`.

Three pieces:

- `cross_plan`: how the keys are cut for the Triton kernel
  (`freescale.kernels.attention.triton_cross`): each sample's keys into at
  most ``max_splits`` *chunks* of ``span_i`` keys (a multiple of
  ``min_chunk``), one program per chunk and head. Torch ops on ``[B]``
  tensors, no host read: built once per forward and shared by every layer;
- `cross_attention_reference`: the torch twin, one sample at a time (the
  softmax written out; any float dtype, float64 for tests), differentiable;
- `cross_attention`: the twin on the CPU, the Triton kernel on CUDA
  (``impl=`` or ``FREESCALE_KERNELS`` force one, `freescale.kernels.backend`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from freescale.kernels.backend import choose_impl, triton_module

BLOCK_N = 64  # keys per tile of the kernel
MIN_CHUNK = 256  # keys per chunk at least (a multiple of BLOCK_N)
MAX_SPLITS = 32  # chunks per sample at most: bounds the partial results
HEAD_DIMS = (16, 32, 64, 128)  # the Triton kernel's (powers of two: tl.dot tiles)


@dataclass(frozen=True)
class CrossPlan:
    """The chunks of one batch's keys (device tensors) and the bounds the
    launcher sizes its grid and buffers by (host ints, from tensor sizes only).

    Sample ``i``'s chunks are ``chunk_offsets[i] .. chunk_offsets[i + 1]``;
    chunk ``j`` of it holds keys ``[j * span[i], min((j + 1) * span[i], L_i))``
    (never empty). Its partial results (one per query and chunk) are rows
    ``part_offsets[i] + r * chunks_i + j`` for query ``r``."""

    q_offsets: Tensor  # int64 [B + 1]
    k_offsets: Tensor  # int64 [B + 1]
    chunk_offsets: Tensor  # int32 [B + 1]
    span: Tensor  # int32 [B]: keys per chunk
    part_offsets: Tensor  # int64 [B + 1]
    splits_bound: int  # chunks per sample at most
    block_n: int = BLOCK_N
    min_chunk: int = MIN_CHUNK

    @property
    def batch(self) -> int:
        return self.q_offsets.numel() - 1

    def max_chunks(self, num_keys: int) -> int:
        """Programs per head: ``sum_i ceil(L_i / min_chunk) <= num_keys / min_chunk + B``,
        and the surplus covers the rows after the last sample (padding)."""
        return -(-num_keys // self.min_chunk) + self.batch

    def max_partials(self, num_queries: int) -> int:
        """Partial rows: at most ``splits_bound`` per query."""
        return num_queries * self.splits_bound

    def tensors(self) -> list[Tensor]:
        """The device tensors it holds."""
        return [self.q_offsets, self.k_offsets, self.chunk_offsets, self.span, self.part_offsets]


def cross_plan(
    q_offsets: Tensor,
    k_offsets: Tensor,
    max_keys: int | None = None,
    *,
    block_n: int = BLOCK_N,
    min_chunk: int = MIN_CHUNK,
    max_splits: int = MAX_SPLITS,
) -> CrossPlan:
    """The chunks of ``k_offsets``' samples; ``max_keys`` (the longest sample,
    when the host knows it) only tightens the partial buffers' size.

    A sample of ``L`` keys is ``tiles = ceil(L / block_n)`` tiles; chunks hold
    ``span = t0 * ceil(ceil(tiles / t0) / max_splits)`` tiles (``t0`` =
    ``min_chunk / block_n``), so there are ``ceil(tiles / span) <=
    min(max_splits, ceil(L / min_chunk))`` of them, none empty: a 17k-key
    history is spread over ``max_splits`` programs, a 300-key one is one."""
    if min_chunk % block_n or min_chunk < block_n or max_splits < 1:
        raise ValueError(f"need min_chunk a multiple of block_n and max_splits >= 1, got "
                         f"{min_chunk}, {block_n}, {max_splits}")  # fmt: skip
    q_offsets, k_offsets = q_offsets.long(), k_offsets.long()
    t0 = min_chunk // block_n
    tiles = (k_offsets[1:] - k_offsets[:-1] + block_n - 1) // block_n
    per = ((tiles + t0 - 1) // t0 + max_splits - 1) // max_splits
    span_tiles = t0 * per.clamp(min=1)
    chunks = (tiles + span_tiles - 1) // span_tiles
    n_q = q_offsets[1:] - q_offsets[:-1]
    chunk_offsets = F.pad(chunks.cumsum(0), (1, 0)).to(torch.int32)
    part_offsets = F.pad((chunks * n_q).cumsum(0), (1, 0))
    bound = max_splits if max_keys is None else min(max_splits, -(-max_keys // min_chunk))
    return CrossPlan(
        q_offsets, k_offsets, chunk_offsets, (span_tiles * block_n).to(torch.int32),
        part_offsets, max(bound, 1), block_n, min_chunk,
    )  # fmt: skip


def cross_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor
) -> Tensor:
    """The torch twin: ``q`` [Tq, H, D], ``k``/``v`` [Tk, H, D] -> [Tq, H, D]
    in ``q``'s dtype (computed in it), one sample at a time (offsets read on
    the host). Rows outside every query segment get 0."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    qb, kb = q_offsets.tolist(), k_offsets.tolist()
    pieces, done = [], 0
    for i in range(len(qb) - 1):
        q0, q1, k0, k1 = qb[i], qb[i + 1], kb[i], kb[i + 1]
        if q1 == q0:
            continue
        pieces.append(q.new_zeros(q0 - done, *q.shape[1:]))
        if k1 == k0:
            pieces.append(q.new_zeros(q1 - q0, *q.shape[1:]))
        else:
            scores = torch.einsum("nhd,lhd->hnl", q[q0:q1], k[k0:k1]) * scale
            weights = torch.softmax(scores, dim=-1)
            pieces.append(torch.einsum("hnl,lhd->nhd", weights, v[k0:k1]))
        done = q1
    pieces.append(q.new_zeros(q.shape[0] - done, *q.shape[1:]))
    return torch.cat(pieces)


def cross_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    k_offsets: Tensor,
    plan: CrossPlan | None = None,
    *,
    impl: str | None = None,
) -> Tensor:
    """Each query segment ``i`` of ``q`` attends to key segment ``i`` of ``k``/``v``.

    ``plan``: `cross_plan` of the offsets, built once and reused (Triton only).
    Differentiable in ``q``, ``k``, ``v`` on every path."""
    if choose_impl(impl, q.device) != "triton":
        return cross_attention_reference(q, k, v, q_offsets, k_offsets)
    plan = plan if plan is not None else cross_plan(q_offsets, k_offsets)
    return triton_module("attention.cross").cross_attention_triton(q, k, v, plan)
