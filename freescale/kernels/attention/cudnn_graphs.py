"""cuDNN SDPA graphs of causal self-attention on the packed (THD) layout: their
declaration only (no torch, no device), so the frontend can validate and lower
them on a machine without a GPU (the removed ``scripts/gpu_cudnn_attention.py
--cpu-check`` did; in git history at 38f0471).

The layout is the one the issue-32 probe measured as its
"ragged stats, int64 offsets" variant (docs/notes/cudnn-attention.md): the
model's packed ``(T, H, D)`` rows are declared ``(B, H, S, D)`` with the
strides of ``(B, S, H, D)`` and each sample's start given by a ragged offset
(in elements); ``S`` only bounds the lengths, which the padding mask's
``seq_len_q/kv`` (int32, ``(B, 1, 1, 1)``) hold. The log-sum-exp statistics
are packed ``(T, H, 1)`` float32, ragged too. Causal = top-left diagonal
alignment with right bound 0.

Two row layouts of q, k, v (and of dq, dk, dv, which mirror them):

- ``token_stride = H·D``: three separate contiguous tensors (the probe's);
- ``token_stride = 3·H·D``: three views of one ``(T, 3·H·D)`` qkv projection
  (the model's ``qkv(x).chunk(3)``; TransformerEngine's T3HD), read in place.

o and dO are always contiguous ``(T, H, D)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

# Roles bound to a data buffer at each execute (besides the offsets and lengths).
FWD_DATA = ("q", "k", "v", "o", "stats")
BWD_DATA = ("q", "k", "v", "o", "dO", "stats", "dq", "dk", "dv")
OFFSETS = ("q_off", "k_off", "v_off", "o_off", "stats_off")
LENGTHS = ("seq_q", "seq_kv")


@dataclass(frozen=True)
class GraphSpec:
    """What one graph is built for; the lengths and offsets are bound at run time.

    A graph serves every batch of ``samples`` samples whose longest is at most
    ``s_cap`` and (backward) whose rows are at most ``t_cap``."""

    samples: int  # B
    heads: int  # H
    head_dim: int  # D
    s_cap: int  # S of the (B, H, S, D) declaration: >= the longest sample
    token_stride: int  # of q, k, v (and dq, dk, dv): H·D, or 3·H·D (views of one qkv)
    dtype: str = "bf16"  # bf16 | fp16
    # backward only (0 in a forward's spec): max_total_seq_len_q/kv, the bound
    # of the packed rows that sizes the backward's workspace (>= the rows run)
    t_cap: int = 0


def offset_units(spec: GraphSpec) -> dict[str, int]:
    """Elements per token of each ragged offset: the offsets bound at run time
    are the samples' token offsets times these."""
    hd = spec.heads * spec.head_dim
    tok = spec.token_stride
    return {"q_off": tok, "k_off": tok, "v_off": tok, "o_off": hd, "stats_off": spec.heads}


def layouts(spec: GraphSpec) -> dict[str, tuple[list[int], list[int]]]:
    """(dim, stride) of the three kinds of tensor: q/k/v rows, o rows, stats."""
    b, h, s, d = spec.samples, spec.heads, spec.s_cap, spec.head_dim
    dim = [b, h, s, d]
    return {
        "qkv": (dim, [s * spec.token_stride, d, spec.token_stride, 1]),
        "o": (dim, [s * h * d, d, h * d, 1]),
        "stats": ([b, h, s, 1], [s * h, 1, h, 1]),
    }


def _inputs(cudnn: Any, g: Any, spec: GraphSpec) -> dict[str, Any]:
    """Offsets, lengths and q/k/v of a graph (every graph has them)."""
    dt = cudnn.data_type
    io = dt.BFLOAT16 if spec.dtype == "bf16" else dt.HALF
    b = spec.samples
    t: dict[str, Any] = {}
    for role in OFFSETS:
        t[role] = g.tensor(name=role, dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT64)
    for role in LENGTHS:
        t[role] = g.tensor(name=role, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
    dim, stride = layouts(spec)["qkv"]
    for role in ("q", "k", "v"):
        t[role] = g.tensor(
            name=role, dim=dim, stride=stride, data_type=io, ragged_offset=t[role + "_off"]
        )
    return t


def _causal(cudnn: Any) -> dict[str, Any]:
    return {
        "diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT,
        "diagonal_band_right_bound": 0,
    }


def _scale(spec: GraphSpec) -> float:
    return 1.0 / math.sqrt(spec.head_dim)  # varlen_attn's (and SDPA's) default


def declare_forward(cudnn: Any, g: Any, spec: GraphSpec) -> dict[str, Any]:
    """The forward on graph ``g``: o and the statistics. Returns role -> graph tensor."""
    t = _inputs(cudnn, g, spec)
    o, stats = g.sdpa(
        name="sdpa_fwd",
        q=t["q"],
        k=t["k"],
        v=t["v"],
        attn_scale=_scale(spec),
        generate_stats=True,
        use_padding_mask=True,
        seq_len_q=t["seq_q"],
        seq_len_kv=t["seq_kv"],
        **_causal(cudnn),
    )
    lay = layouts(spec)
    o.set_output(True).set_dim(lay["o"][0]).set_stride(lay["o"][1]).set_ragged_offset(t["o_off"])
    stats.set_output(True).set_data_type(cudnn.data_type.FLOAT)
    stats.set_dim(lay["stats"][0]).set_stride(lay["stats"][1]).set_ragged_offset(t["stats_off"])
    t["o"], t["stats"] = o, stats
    return t


def declare_backward(cudnn: Any, g: Any, spec: GraphSpec) -> dict[str, Any]:
    """The backward on graph ``g``: dq, dk, dv (laid out as q, k, v)."""
    if spec.t_cap < 1:
        raise ValueError(f"a backward graph needs t_cap >= 1, got {spec.t_cap}")
    dt = cudnn.data_type
    io = dt.BFLOAT16 if spec.dtype == "bf16" else dt.HALF
    t = _inputs(cudnn, g, spec)
    lay = layouts(spec)
    for role in ("o", "dO"):  # dO shares o's layout and offsets
        t[role] = g.tensor(
            name=role, dim=lay["o"][0], stride=lay["o"][1], data_type=io, ragged_offset=t["o_off"]
        )
    t["stats"] = g.tensor(
        name="stats",
        dim=lay["stats"][0],
        stride=lay["stats"][1],
        data_type=dt.FLOAT,
        ragged_offset=t["stats_off"],
    )
    dq, dk, dv = g.sdpa_backward(
        name="sdpa_bwd",
        q=t["q"],
        k=t["k"],
        v=t["v"],
        o=t["o"],
        dO=t["dO"],
        stats=t["stats"],
        attn_scale=_scale(spec),
        use_padding_mask=True,
        seq_len_q=t["seq_q"],
        seq_len_kv=t["seq_kv"],
        # An upper bound of the packed rows: it sizes the workspace (the dQ
        # accumulator, the softmax sums) to t_cap rows instead of B·S; the
        # kernels index by the ragged offsets, so any batch of at most t_cap
        # rows runs on it (docs/notes/cudnn-attention.md).
        max_total_seq_len_q=spec.t_cap,
        max_total_seq_len_kv=spec.t_cap,
        **_causal(cudnn),
    )
    dim, stride = lay["qkv"]
    for x, off in ((dq, "q_off"), (dk, "k_off"), (dv, "v_off")):
        x.set_output(True).set_dim(dim).set_stride(stride).set_ragged_offset(t[off])
    t["dq"], t["dk"], t["dv"] = dq, dk, dv
    return t


def check_roles(tensors: dict[str, Any], data_roles: tuple[str, ...]) -> None:
    """Every graph tensor gets a buffer at execute: offsets, lengths and ``data_roles``."""
    want = set(OFFSETS) | set(LENGTHS) | set(data_roles)
    if set(tensors) != want:
        raise RuntimeError(f"graph roles {sorted(tensors)} != {sorted(want)}")
