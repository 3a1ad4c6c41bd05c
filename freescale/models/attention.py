"""Jagged attention: a per-sample reference (CPU) and a varlen path (CUDA).

Two patterns per layer:
- UIH self-attention, causal within each sample;
- candidate -> UIH cross-attention (every candidate of a sample attends to
  that sample's whole UIH; candidates do not see each other).
Both cost Σ_i L_i² (resp. Σ_i N_i·L_i): no padding, so a rank's compute
time genuinely grows with its samples' lengths. A query with no keys (empty
UIH) gets a zero output.

What a pattern needs besides q/k/v (int32 boundaries, maxima, the mask of
key-less queries, host boundaries for the reference) depends only on the
batch's layout, not on the layer: `AttentionLayout` holds it, built once per
forward by the model and shared by every layer (a layer used to rebuild it
twice, ~8 small kernels each, and read maxima back on the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

IMPLS = ("auto", "reference", "varlen")


@dataclass(frozen=True)
class Segments:
    """One jagged layout as attention reads it."""

    offsets: Tensor  # int64 [B + 1]
    cu: Tensor | None = None  # int32 copy of ``offsets`` (varlen)
    max_len: int = 0  # longest segment (varlen)
    bounds: list[int] | None = None  # ``offsets`` on the host (reference)


@dataclass(frozen=True)
class AttentionLayout:
    """Query segment i attends to key segment i (causally when ``causal``)."""

    impl: str  # reference | varlen
    q: Segments
    k: Segments
    causal: bool
    no_keys: Tensor | None = None  # [Tq, 1, 1] bool: queries whose sample has no keys
    # [T, 1, 1] bool: rows outside every segment (padding), whose flash
    # gradients are never written: they are zeroed before they reach a weight.
    q_pad: Tensor | None = None
    k_pad: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        """The device tensors it holds (offsets, masks)."""
        held = (self.q.offsets, self.q.cu, self.k.offsets, self.k.cu)
        return [t for t in (*held, self.no_keys, self.q_pad, self.k_pad) if t is not None]


def resolve_impl(impl: str, on_cuda: bool) -> str:
    """``auto`` -> ``varlen`` on CUDA, ``reference`` elsewhere."""
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be auto, reference or varlen, got {impl!r}")
    if impl == "auto":
        return "varlen" if on_cuda else "reference"
    return impl


def segments(offsets: Tensor, impl: str, max_len: int | None = None) -> Segments:
    """``offsets`` prepared for ``impl`` (resolved); ``max_len`` spares a host read."""
    if impl == "reference":
        return Segments(offsets, bounds=offsets.tolist())
    if max_len is None:
        max_len = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
    return Segments(offsets, cu=offsets.to(torch.int32), max_len=max_len)


def attention_layout(q: Segments, k: Segments, causal: bool, num_queries: int) -> AttentionLayout:
    """The layout of one pattern; the key-less mask is skipped where it is all
    false by construction (queries and keys share one layout)."""
    impl = "reference" if q.bounds is not None else "varlen"
    no_keys = None
    if impl == "varlen" and q.offsets is not k.offsets:
        k_len = k.offsets[1:] - k.offsets[:-1]
        q_len = q.offsets[1:] - q.offsets[:-1]
        empty = torch.repeat_interleave(k_len == 0, q_len, output_size=num_queries)
        no_keys = empty[:, None, None]
    return AttentionLayout(impl, q, k, causal, no_keys)


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, q_offsets: Tensor, k_offsets: Tensor, causal: bool
) -> Tensor:
    """q: [Tq, H, d], k/v: [Tk, H, d]; segment i of q attends to segment i of k."""
    return _reference(q, k, v, q_offsets.tolist(), k_offsets.tolist(), causal)


def _reference(
    q: Tensor, k: Tensor, v: Tensor, qb: list[int], kb: list[int], causal: bool
) -> Tensor:
    out = torch.zeros_like(q)
    for i in range(len(qb) - 1):
        q0, q1, k0, k1 = qb[i], qb[i + 1], kb[i], kb[i + 1]
        if q1 == q0 or k1 == k0:
            continue
        qi, ki, vi = (t.transpose(0, 1) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        out[q0:q1] = F.scaled_dot_product_attention(qi, ki, vi, is_causal=causal).transpose(0, 1)
    return out


def _varlen(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout) -> Tensor:
    """Flash varlen attention (CUDA, bf16/fp16) over packed segments."""
    from torch.nn.attention.varlen import varlen_attn

    dtype = q.dtype
    half = torch.bfloat16 if dtype == torch.float32 else dtype
    if layout.q_pad is not None and layout.k_pad is not None:
        q = _ZeroGradRows.apply(q, layout.q_pad)
        k = _ZeroGradRows.apply(k, layout.k_pad)
        v = _ZeroGradRows.apply(v, layout.k_pad)
    out = varlen_attn(
        q.to(half),
        k.to(half),
        v.to(half),
        layout.q.cu,
        layout.k.cu,
        max(layout.q.max_len, 1),
        max(layout.k.max_len, 1),
        window_size=(-1, 0) if layout.causal else (-1, -1),
    )
    out = out.to(dtype)
    if layout.no_keys is None:
        return out
    # Queries of a sample without keys have nothing to attend to: output 0.
    return out.masked_fill(layout.no_keys, 0.0)


class _ZeroGradRows(torch.autograd.Function):
    """Identity forward; the gradient of the ``rows`` rows becomes exactly 0
    (a select, so even garbage there is dropped)."""

    @staticmethod
    def forward(ctx, x: Tensor, rows: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(rows)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (rows,) = ctx.saved_tensors
        return torch.where(rows, 0.0, grad), None


def attend(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout) -> Tensor:
    """Attention of one pattern whose layout was built once for the forward."""
    if layout.impl == "reference":
        assert layout.q.bounds is not None and layout.k.bounds is not None
        return _reference(q, k, v, layout.q.bounds, layout.k.bounds, layout.causal)
    return _varlen(q, k, v, layout)


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
    """One call: ``varlen`` on CUDA, ``reference`` elsewhere (or when forced)."""
    impl = resolve_impl(impl, q.is_cuda)
    qs = segments(q_offsets, impl, max_q)
    ks = qs if k_offsets is q_offsets and max_q == max_k else segments(k_offsets, impl, max_k)
    return attend(q, k, v, attention_layout(qs, ks, causal, q.shape[0]))
