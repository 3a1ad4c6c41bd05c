"""Softmax jagged attention over the batch padded to its widest sample.

The per-sample reference (`attention.py`) loops over samples on the host, and
varlen / cuDNN / Triton are CUDA kernels sized from host integers: none of
them is one program for every batch shape. This path is: each pattern's rows
are scattered into ``[B, H, width, d]`` slots (``width`` at least the longest
segment; an exported program gets it as a dynamic size, `freescale.serving`),
one ``scaled_dot_product_attention`` runs over the batch, and the filled slots
are gathered back. Its work grows with ``B · width²`` rather than ``Σ L_i²``,
so it serves exported programs, not training.

- causal self-attention: padded keys lie after every real query of their
  sample, so the causal mask alone hides them (no mask tensor);
- cross-attention: a key-padding mask; a sample without keys gets output 0,
  as in the reference.

It agrees with the reference to rounding (another reduction order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from freescale.jagged.ops import segment_ids


@dataclass(frozen=True)
class Padded:
    """One jagged layout padded to ``width`` slots per sample."""

    width: int
    segment: Tensor  # [T] the sample of each row
    slot: Tensor  # [T] sample · width + position within the sample
    lengths: Tensor  # [B]


def padded(offsets: Tensor, total: int, width: int) -> Padded:
    """The slots of ``total`` rows laid out by ``offsets`` (``width`` >= every segment)."""
    segment = segment_ids(offsets, total)
    position = torch.arange(total, device=offsets.device) - offsets[segment]
    return Padded(width, segment, segment * width + position, offsets.diff())


def _pad(x: Tensor, p: Padded) -> Tensor:
    """[T, H, d] -> [B, H, width, d], zeros in the empty slots."""
    batch = p.lengths.shape[0]
    flat = x.new_zeros(batch * p.width, *x.shape[1:]).index_copy(0, p.slot, x)
    return flat.view(batch, p.width, *x.shape[1:]).transpose(1, 2)


def _unpad(x: Tensor, p: Padded) -> Tensor:
    """[B, H, width, d] -> [T, H, d]: the filled slots."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]).index_select(0, p.slot)


def padded_attention(
    q: Tensor, k: Tensor, v: Tensor, q_pad: Padded, k_pad: Padded, causal: bool
) -> Tensor:
    """q: [Tq, H, d], k/v: [Tk, H, d]; segment i of q attends to segment i of k
    (causally: the self-attention, ``q_pad`` then is ``k_pad``)."""
    qp, kp, vp = _pad(q, q_pad), _pad(k, k_pad), _pad(v, k_pad)
    if causal:
        return _unpad(F.scaled_dot_product_attention(qp, kp, vp, is_causal=True), q_pad)
    width = k_pad.width
    keys = torch.arange(width, device=k.device)[None, :] < k_pad.lengths[:, None]
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=keys[:, None, None, :])
    no_keys = (k_pad.lengths == 0)[q_pad.segment][:, None, None]
    return torch.where(no_keys, 0.0, _unpad(out, q_pad))  # (their rows are NaN)
