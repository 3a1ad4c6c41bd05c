"""The jagged softmax attention as one `torch.library` op, for exported programs.

``freescale::jagged_attention(q, k, v, q_offsets, k_offsets, causal)``: query
segment i attends to key segment i (causally for the UIH self-attention,
where both offsets are the same), a query whose sample has no keys gets 0.
`torch.export` keeps it as one opaque node whose output is shaped like ``q``
(the fake kernel), so one program serves every batch shape at Σ L_i² work,
where the padded fallback (`padded_attention`) costs B · L_max². Inside,
`jagged_attention` runs the model's ``attention`` / ``cross_attention``
options as the eval forward resolves them on that device: the per-sample
reference on the CPU (bitwise the eval forward's), cuDNN or varlen and the
Triton cross-attention on CUDA.

The op lives in Python: a program or AOTInductor package that calls it loads
in a process that imported ``freescale`` (`freescale.serving.load` does), not
in a C++-only runtime; export with ``attention="padded"`` for that
(`freescale.serving.exporter`). Inference only: it has no autograd formula.
Each call builds its own layout (on CUDA a host read of the maxima, per layer
and pattern), where the eval forward builds one per forward.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import Tensor

from freescale.models.attention import cross_attention_impl, jagged_attention


@torch.library.custom_op("freescale::jagged_attention", mutates_args=())
def jagged_attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    k_offsets: Tensor,
    causal: bool,
    attention: str = "auto",
    cross: str = "auto",
) -> Tensor:
    """q: [Tq, H, d], k/v: [Tk, H, d] -> [Tq, H, d], contiguous. ``attention``
    and ``cross``: the model's options, resolved here for the device the
    program runs on (`self_attention_impl`, `cross_attention_impl`)."""
    # The causal pattern is a self-attention: its keys' offsets are the queries'
    # (one object, as the model's layouts have it).
    keys = q_offsets if causal else k_offsets
    impl = attention if causal else cross_attention_impl(cross, attention, q.is_cuda, q.shape[-1])
    return jagged_attention(q, k, v, q_offsets, keys, causal, impl=impl).contiguous()


@jagged_attention_op.register_fake
def _(q, k, v, q_offsets, k_offsets, causal, attention="auto", cross="auto"):
    return q.new_empty(q.shape)


# What `torch.export` traces: ``jagged`` (this op) or ``padded``; the exporter's choice.
_EXPORTED: contextvars.ContextVar[str] = contextvars.ContextVar(
    "exported_attention", default="jagged"
)
EXPORTED_KINDS = ("jagged", "padded")


@contextlib.contextmanager
def exported_attention(kind: str) -> Iterator[None]:
    """Trace the sequence model's attention as ``kind`` inside the block."""
    if kind not in EXPORTED_KINDS:
        raise ValueError(f"exported attention must be jagged or padded, got {kind!r}")
    token = _EXPORTED.set(kind)
    try:
        yield
    finally:
        _EXPORTED.reset(token)


def exported_kind() -> str:
    return _EXPORTED.get()
