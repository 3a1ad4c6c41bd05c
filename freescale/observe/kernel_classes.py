"""GPU time per kernel class in a profiler trace: where a step's time goes.

A step's GPU busy time (the union of its kernels, copies and memsets over
every stream of a device) is split into the classes below, by kernel name,
so that a change to one class (fused blocks, another attention kernel) shows
in its own column and the columns add up to the busy time: where kernels of
several streams overlap, each instant is shared equally among the kernels
running then (a plain sum over streams counts it once per stream, and read
as a step's time it overstates it). `kernel_class` is the one
place the name patterns live; the patterns are those of the kernels torch,
cuBLAS, cuDNN, FlashAttention and Triton name on an H100/H200 (first match wins):

- ``self_attn_fwd`` / ``self_attn_bwd``: cuDNN's SDPA kernels (``cudnn`` or
  ``sdpa`` in the name; ``bprop``/``bwd``/``dgrad`` mark the backward);
- ``cross_attn``: FlashAttention's varlen kernels (``flash_fwd*``,
  ``flash_bwd*``) and any kernel named ``*cross_attn*``/``*cross_attention*``.
  With ``model.attention=auto`` on sm90+ the self-attention is cuDNN's, so the
  flash kernels are the candidate→history cross-attention; under
  ``attention=varlen`` (and inside CUDA graphs) they are both;
- ``gemm``: cuBLAS/cuBLASLt (``nvjet*``, ``*gemm*``, ``*gemv*``, ``cutlass*``,
  ``*xmma*``, ``splitKreduce``) and Inductor's matmul templates (``triton_tem*``);
- ``layer_norm``: torch's layer norm forward, backward and γ/β backward;
- ``concat``: ``CatArrayBatchedCopy*`` (torch.cat);
- ``reduction``: torch's ``reduce_kernel``;
- ``elementwise``: torch's ``*elementwise_kernel*`` (vectorized, unrolled,
  plain, indexed);
- ``inductor``: Inductor's generated kernels (``triton_poi*``, ``triton_red*``,
  ``triton_per*``, …): the fused memory-bound work of ``dense.compile``;
- ``triton``: other Triton kernels (ours: a plain identifier such as
  ``_small_table_grad_kernel``, which no library kernel above is);
- ``other``: the rest (NCCL, index/scatter kernels, memcpy and memset).

``memory_bound`` = elementwise + layer norm + concat + reduction + inductor:
what the issue's fused-block target counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from freescale.observe.trace import GPU_CATS, STEP_PREFIX

CLASSES = (
    "self_attn_fwd", "self_attn_bwd", "cross_attn", "gemm", "layer_norm", "concat",
    "reduction", "elementwise", "inductor", "triton", "other",
)  # fmt: skip
MEMORY_BOUND = ("elementwise", "layer_norm", "concat", "reduction", "inductor")

_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("other", ("nccl",)),
    ("cross_attn", ("cross_attn", "cross_attention", "flash_fwd", "flash_bwd")),
    ("gemm", ("triton_tem", "nvjet", "gemm", "gemv", "cutlass", "xmma", "splitkreduce")),
    ("inductor", ("triton_",)),
    ("layer_norm", ("layer_norm", "layernorm", "gammabeta", "gamma_beta")),
    ("concat", ("catarraybatchedcopy",)),
    ("reduction", ("reduce_kernel",)),
    ("elementwise", ("elementwise_kernel",)),
)


def kernel_class(name: str) -> str:
    """The class (`CLASSES`) of a GPU kernel, by its name in the trace."""
    low = name.lower()
    if "cudnn" in low or "sdpa" in low:
        backward = any(k in low for k in ("bprop", "bwd", "dgrad", "backward"))
        return "self_attn_bwd" if backward else "self_attn_fwd"
    for cls, patterns in _RULES:
        if any(p in low for p in patterns):
            return cls
    return "triton" if _PLAIN.fullmatch(name) else "other"


@dataclass
class ClassTime:
    ms: float  # per step: its share of the busy time (overlaps shared equally)
    launches: float  # per step
    stream_ms: float = 0.0  # per step: the plain sum of durations over streams


def share_busy_time(spans: list[tuple[float, float, str]]) -> dict[str, float]:
    """Per class, its share of the union of ``spans`` (start, end, class): each
    instant split equally among the spans covering it, so the shares sum to the
    union's length exactly."""
    edges = sorted(
        [(s, 1, c) for s, e, c in spans if e > s] + [(e, -1, c) for s, e, c in spans if e > s]
    )
    share: dict[str, float] = {}
    active: dict[str, int] = {}
    n, last = 0, 0.0
    for t, delta, cls in edges:
        if n and t > last:
            for c, k in active.items():
                if k:
                    share[c] = share.get(c, 0.0) + (t - last) * k / n
        active[cls] = active.get(cls, 0) + delta
        n += delta
        last = t
    return share


def kernel_times(trace: dict[str, Any]) -> dict[str, ClassTime]:
    """Per class (every one of `CLASSES`, then ``memory_bound``, then ``busy``: the
    union over streams, which the classes sum to): GPU ms and launches per traced
    step (the trace's ``ProfilerStep#`` spans; 1 if none). Memcpy and memset
    count as ``other``. Devices are shared out apart and added."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace (no traceEvents list)")
    us = dict.fromkeys(CLASSES, 0.0)
    count = dict.fromkeys(CLASSES, 0)
    by_device: dict[Any, list[tuple[float, float, str]]] = {}
    steps = 0
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        cat, name = str(ev.get("cat", "")).lower(), str(ev.get("name", ""))
        if cat in GPU_CATS:
            cls = kernel_class(name) if cat == "kernel" else "other"
            start, dur = float(ev.get("ts", 0.0)), float(ev.get("dur", 0.0))
            us[cls] += dur
            count[cls] += 1
            device = (ev.get("args") or {}).get("device", ev.get("pid"))
            by_device.setdefault(device, []).append((start, start + dur, cls))
        elif name.startswith(STEP_PREFIX) and not cat.startswith("gpu_"):
            steps += 1
    shared = dict.fromkeys(CLASSES, 0.0)
    for spans in by_device.values():
        for c, v in share_busy_time(spans).items():
            shared[c] += v
    n = max(steps, 1)
    out = {c: ClassTime(shared[c] / 1e3 / n, count[c] / n, us[c] / 1e3 / n) for c in CLASSES}
    out["memory_bound"] = _total(out, MEMORY_BOUND)
    out["busy"] = _total(out, CLASSES)
    return out


def _total(times: dict[str, ClassTime], classes: tuple[str, ...]) -> ClassTime:
    return ClassTime(*(sum(getattr(times[c], f) for c in classes)
                       for f in ("ms", "launches", "stream_ms")))  # fmt: skip
