"""GPU time per kernel class in a profiler trace: where a step's time goes.

Issue 42's table splits a step's kernel time (summed over streams) into the
classes below, by kernel name, so that a change to one class (fused blocks,
another attention kernel) shows in its own column. `kernel_class` is the one
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
    ms: float  # per step, summed over streams
    launches: float  # per step


def kernel_times(trace: dict[str, Any]) -> dict[str, ClassTime]:
    """Per class (every one of `CLASSES`, then ``memory_bound``): GPU ms and
    launches per traced step (the trace's ``ProfilerStep#`` spans; 1 if none).
    Memcpy and memset count as ``other``."""
    events = trace.get("traceEvents") if isinstance(trace, dict) else None
    if not isinstance(events, list):
        raise ValueError("not a Chrome trace (no traceEvents list)")
    us = dict.fromkeys(CLASSES, 0.0)
    count = dict.fromkeys(CLASSES, 0)
    steps = 0
    for ev in events:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        cat, name = str(ev.get("cat", "")).lower(), str(ev.get("name", ""))
        if cat in GPU_CATS:
            cls = kernel_class(name) if cat == "kernel" else "other"
            us[cls] += float(ev.get("dur", 0.0))
            count[cls] += 1
        elif name.startswith(STEP_PREFIX) and not cat.startswith("gpu_"):
            steps += 1
    n = max(steps, 1)
    out = {c: ClassTime(us[c] / 1e3 / n, count[c] / n) for c in CLASSES}
    out["memory_bound"] = ClassTime(
        sum(out[c].ms for c in MEMORY_BOUND), sum(out[c].launches for c in MEMORY_BOUND)
    )
    return out
