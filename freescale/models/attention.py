"""Jagged attention: a per-sample reference (CPU), a varlen path (CUDA) and,
for the causal self-attention, an optional cuDNN path (`cudnn_sdpa`).

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

Implementations (``impl``, the model's ``attention`` option):
- ``reference``: per-sample SDPA loops (CPU; the reference twin of the others);
- ``op``: the model's own implementations behind one `torch.library` op
  (`attention_op`): what an exported program calls
  (`freescale.serving`), not a training option;
- ``padded``: the batch padded to its widest sample, one SDPA
  (`padded_attention`): an exported program's self-contained fallback;
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention-2, CUDA);
- ``cudnn``: the causal self-attention through cuDNN's SDPA graphs
  (`freescale.kernels.attention.cudnn_sdpa`; sm90+, the ``nvidia-cudnn-frontend``
  package); the cross-attention stays on varlen (it is cheap);
- ``auto``: ``reference`` on the CPU; on CUDA ``cudnn`` for the causal
  self-attention where it can run (`cudnn_sdpa.unavailable`), else
  ``varlen``. Where cuDNN then refuses a graph, that call runs varlen.

The cross-attention has its own option (``cross``, the model's
``cross_attention``, `cross_attention_impl`): ``reference``, ``varlen``,
``triton`` (`freescale.kernels.attention.triton_cross`: the few queries of a
sample against its history split over many programs, then a reduce; needs
no maxima) or ``auto``: ``triton`` on CUDA where the attention is ``auto`` or
``cudnn`` (and Triton is installed), else what the attention runs
(``varlen`` keeps both patterns on varlen: the A/B against the old path).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from freescale.kernels.attention import cudnn_sdpa
from freescale.kernels.attention.cross import HEAD_DIMS, CrossPlan, cross_plan
from freescale.kernels.backend import triton_available, triton_module
from freescale.models.padded_attention import Padded, padded_attention

IMPLS = ("auto", "reference", "varlen", "cudnn")
CROSS_IMPLS = ("auto", "reference", "varlen", "triton")


@dataclass(frozen=True)
class Segments:
    """One jagged layout as attention reads it."""

    offsets: Tensor  # int64 [B + 1]
    cu: Tensor | None = None  # int32 copy of ``offsets`` (varlen)
    max_len: int = 0  # longest segment (varlen)
    bounds: list[int] | None = None  # ``offsets`` on the host (reference)
    ragged: cudnn_sdpa.Ragged | None = None  # cuDNN's view (its causal self-attention)
    padded: Padded | None = None  # slots of the padded batch (``padded``)


@dataclass(frozen=True)
class AttentionLayout:
    """Query segment i attends to key segment i (causally when ``causal``)."""

    impl: str  # reference | varlen | cudnn | padded | op | triton (the cross pattern only)
    q: Segments
    k: Segments
    causal: bool
    no_keys: Tensor | None = None  # [Tq, 1, 1] bool: queries whose sample has no keys
    # [T, 1, 1] bool: rows outside every segment (padding), whose flash
    # gradients are never written: they are zeroed before they reach a weight.
    q_pad: Tensor | None = None
    k_pad: Tensor | None = None
    plan: CrossPlan | None = None  # triton: the key chunks (`kernels.attention.cross`)
    options: tuple[str, str] = ("auto", "auto")  # op: the model's attention, cross_attention

    def tensors(self) -> list[Tensor]:
        """The device tensors it holds (offsets, masks, the cross plan's)."""
        held = (self.q.offsets, self.q.cu, self.k.offsets, self.k.cu)
        ragged = self.q.ragged.tensors() if self.impl == "cudnn" and self.q.ragged else []
        plan = self.plan.tensors() if self.plan is not None else []
        extra = (*ragged, *plan, self.no_keys, self.q_pad, self.k_pad)
        return [t for t in (*held, *extra) if t is not None]


def resolve_impl(impl: str, on_cuda: bool) -> str:
    """The implementation of the patterns cuDNN does not run (the cross-attention):
    ``auto`` and ``cudnn`` -> ``varlen`` on CUDA; ``auto`` -> ``reference`` elsewhere."""
    check_impl(impl)
    if impl == "auto":
        return "varlen" if on_cuda else "reference"
    return "varlen" if impl == "cudnn" else impl


def check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"attention impl must be auto, reference, varlen or cudnn, got {impl!r}")


def cross_attention_impl(
    cross: str, attention: str, on_cuda: bool, head_dim: int, triton: bool = True
) -> str:
    """The candidate -> UIH cross-attention's implementation: ``cross`` unless
    ``auto``; then ``triton`` on CUDA where ``attention`` is ``auto`` or
    ``cudnn``, Triton is installed, the kernel takes ``head_dim``
    (`kernels.attention.cross.HEAD_DIMS`) and ``triton`` allows it (a graphed
    stack says no: its graphs run varlen), else `resolve_impl` of ``attention``."""
    if cross not in CROSS_IMPLS:
        raise ValueError(
            f"cross-attention impl must be one of {', '.join(CROSS_IMPLS)}, got {cross!r}"
        )
    if cross != "auto":
        return cross
    base = resolve_impl(attention, on_cuda)
    usable = triton and head_dim in HEAD_DIMS and triton_available()
    if base == "varlen" and attention in ("auto", "cudnn") and usable:
        return "triton"
    return base


def self_attention_impl(
    impl: str, device: torch.device | None, head_dim: int, cudnn: bool = True
) -> str:
    """The causal self-attention's implementation on ``device`` (None: the CPU).

    ``auto``: ``cudnn`` on a CUDA device where it can run (and ``cudnn`` is
    allowed: not inside CUDA graphs), else ``varlen``; ``reference`` on the
    CPU. ``cudnn`` where it cannot run: a one-line ValueError naming what is
    missing."""
    check_impl(impl)
    device = device or torch.device("cpu")
    if impl == "cudnn":
        why = cudnn_sdpa.unavailable(device, head_dim)
        if why:
            raise ValueError(f"model.attention=cudnn needs {why}")
        return "cudnn"
    on_cuda = device.type == "cuda"
    if impl == "auto" and on_cuda and cudnn:
        return "cudnn" if cudnn_sdpa.unavailable(device, head_dim) is None else "varlen"
    return resolve_impl(impl, on_cuda)


def segments(
    offsets: Tensor, impl: str, max_len: int | None = None, fallback: bool = False
) -> Segments:
    """``offsets`` prepared for ``impl`` (resolved); ``max_len`` spares a host read.

    ``cudnn``: the varlen preparation (the cross-attention reads it) and
    cuDNN's (`cudnn_sdpa.Ragged`); ``fallback``: ``auto`` chose cuDNN, so
    a graph it refuses runs varlen instead of failing."""
    if impl == "reference":
        return Segments(offsets, bounds=offsets.tolist())
    if impl == "triton":  # the cross-attention's queries: the plan needs no maxima
        return Segments(offsets, max_len=max_len or 0)
    if max_len is None:
        max_len = int((offsets[1:] - offsets[:-1]).max()) if offsets.numel() > 1 else 0
    ragged = cudnn_sdpa.Ragged(offsets, max_len, fallback) if impl == "cudnn" else None
    return Segments(offsets, cu=offsets.to(torch.int32), max_len=max_len, ragged=ragged)


def attention_layout(
    q: Segments, k: Segments, causal: bool, num_queries: int, impl: str | None = None
) -> AttentionLayout:
    """The layout of one pattern; the key-less mask is skipped where it is all
    false by construction (queries and keys share one layout). A causal
    self-attention over segments prepared for cuDNN runs there; the rest varlen
    (``reference`` for segments prepared for it), unless ``impl`` says;
    ``triton``: the cross-attention kernel, its plan built here (once per forward)."""
    if impl == "triton":
        if causal:
            raise ValueError("the Triton attention kernel is the cross-attention's (not causal)")
        plan = cross_plan(q.offsets, k.offsets, k.max_len or None)
        return AttentionLayout("triton", q, k, False, plan=plan)
    impl = impl or ("reference" if q.bounds is not None else "varlen")
    if impl == "varlen" and causal and q is k and q.ragged is not None:
        impl = "cudnn"
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


def _cudnn(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout) -> Tensor:
    """cuDNN's causal self-attention (CUDA, sm90+) over packed segments; float32
    inputs run in bf16, as varlen's do. Rows outside every segment (``q_pad``)
    get output 0 and q/k/v gradient 0, as varlen's."""
    ragged = layout.q.ragged
    assert ragged is not None
    dtype = q.dtype
    half = torch.bfloat16 if dtype == torch.float32 else dtype
    qh, kh, vh = q, k, v
    if layout.q_pad is not None and layout.k_pad is not None:
        qh = _ZeroGradRows.apply(q, layout.q_pad)
        kh = _ZeroGradRows.apply(k, layout.k_pad)
        vh = _ZeroGradRows.apply(v, layout.k_pad)
    try:
        out = cudnn_sdpa.causal_attention(qh.to(half), kh.to(half), vh.to(half), ragged)
    except cudnn_sdpa.Unsupported as e:
        if not ragged.fallback:
            raise
        cudnn_sdpa.warn_fallback(e)
        return _varlen(q, k, v, replace(layout, impl="varlen"))
    out = out.to(dtype)
    return out if layout.q_pad is None else out.masked_fill(layout.q_pad, 0.0)


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


def _triton_cross(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout) -> Tensor:
    """The Triton cross-attention (any float dtype, computed in it with fp32
    sums). Rows outside every segment (``q_pad``/``k_pad``) get output and
    gradient 0 from the kernel itself."""
    assert layout.plan is not None
    if not q.dtype == k.dtype == v.dtype:  # the kernel takes one dtype: the widest
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return triton_module("attention.cross").cross_attention_triton(q, k, v, layout.plan)


def attend(q: Tensor, k: Tensor, v: Tensor, layout: AttentionLayout) -> Tensor:
    """Attention of one pattern whose layout was built once for the forward."""
    if layout.impl == "triton":
        return _triton_cross(q, k, v, layout)
    if layout.impl == "op":  # an exported program's (`attention_op`), the model's options
        op = torch.ops.freescale.jagged_attention
        attention, cross = layout.options
        return op(q, k, v, layout.q.offsets, layout.k.offsets, layout.causal, attention, cross)
    if layout.impl == "padded":
        assert layout.q.padded is not None and layout.k.padded is not None
        return padded_attention(q, k, v, layout.q.padded, layout.k.padded, layout.causal)
    if layout.impl == "reference":
        assert layout.q.bounds is not None and layout.k.bounds is not None
        return _reference(q, k, v, layout.q.bounds, layout.k.bounds, layout.causal)
    if layout.impl == "cudnn":
        return _cudnn(q, k, v, layout)
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
    """One call, ``impl`` as the model's (`self_attention_impl` for a causal
    self-attention: ``q_offsets is k_offsets``; `resolve_impl` otherwise);
    ``triton``: the cross-attention kernel (not causal)."""
    if impl == "triton":
        qs, ks = segments(q_offsets, "triton", max_q), segments(k_offsets, "triton", max_k)
        return attend(q, k, v, attention_layout(qs, ks, causal, q.shape[0], impl="triton"))
    shared = k_offsets is q_offsets and max_q == max_k
    if causal and shared:
        chosen = self_attention_impl(impl, q.device, q.shape[-1])
    else:
        chosen = resolve_impl(impl, q.is_cuda)
    qs = segments(q_offsets, chosen, max_q, fallback=impl == "auto")
    ks = qs if shared else segments(k_offsets, resolve_impl(chosen, q.is_cuda), max_k)
    return attend(q, k, v, attention_layout(qs, ks, causal, q.shape[0]))
