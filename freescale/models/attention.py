"""Jagged attention: a per-sample reference (CPU) and a varlen path (CUDA).

Two patterns per layer:
- UIH self-attention, causal within each sample;
- candidate -> UIH cross-attention (every candidate of a sample attends to
  that sample's whole UIH; candidates do not see each other).
Both cost Σ_i L_i² (resp. Σ_i N_i·L_i): no padding, so a rank's compute
time genuinely grows with its samples' lengths. A query with no keys (empty
UIH) gets a zero output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor, causal: bool
) -> Tensor:
    """q: [Tq, H, d], k/v: [Tk, H, d]; segment i of q attends to segment i of k."""
    out = torch.zeros_like(q)
    qb, kb = q_offsets.tolist(), k_offsets.tolist()
    for i in range(len(qb) - 1):
        q0, q1, k0, k1 = qb[i], qb[i + 1], kb[i], kb[i + 1]
        if q1 == q0 or k1 == k0:
            continue
        qi, ki, vi = (t.transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        out[q0:q1] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal).transpose(0, 1)
    return out


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    k_offsets: Tensor,
    causal: bool,
    max_q: int,
    max_k: int,
) -> Tensor:
    """Flash varlen attention (CUDA, bf16/fp16) over packed segments."""
    from torch.nn.attention.varlen import varlen_attn

    dtype = q.dtype
    half = torch.bfloat16 if dtype == torch.float32 else dtype
    cu_q, cu_k = q_offsets.to(torch.int32), k_offsets.to(torch.int32)
    out = varlen_attn(
        q.to(half),
        k.to(half),
        v.to(half),
        cu_q,
        cu_k,
        max(max_q, 1),
        max(max_k, 1),
        window_size=(-1, 0) if causal else (-1, -1),
    )
    out = out.to(dtype)
    # Queries of a sample without keys have nothing to attend to: output 0.
    k_len = k_offsets[1:] - k_offsets[:-1]
    q_len = q_offsets[1:] - q_offsets[:-1]
    empty = torch.repeat_interleave(k_len == 0, q_len, output_size=q.shape[0])
    return out.masked_fill(empty[:, None, None], 0.0)


def jagged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    k_offsets: Tensor,
    causal: bool,
    max_q: int | None = None,
    max_k: int | None = None,
    impl: str = "auto",
) -> Tensor:
    """Dispatch: ``varlen`` on CUDA, ``reference`` elsewhere (or when forced)."""
    if impl == "auto":
        impl = "varlen" if q.is_cuda else "reference"
    if impl == "reference":
        return reference_attention(q, k, v, q_offsets, k_offsets, causal)
    if impl != "varlen":
        raise ValueError(f"attention impl must be auto, reference or varlen, got {impl!r}")
    if max_q is None or max_k is None:
        max_q = int((q_offsets[1:] - q_offsets[:-1]).max()) if q_offsets.numel() > 1 else 0
        max_k = int((k_offsets[1:] - k_offsets[:-1]).max()) if k_offsets.numel() > 1 else 0
    return varlen_attention(q, k, v, q_offsets, k_offsets, causal, max_q, max_k)
