"""Candidate -> history cross-attention: varlen (flash) vs the Triton split-key kernel.

One layer's cross-attention of the built-in model, forward + backward, at a
preset's lengths (h200-21k: lognormal UIH, median 4,500, capped at 17,000;
1..8 candidates per sample) and its heads (4 x 64, bf16), per batch size.
q, k and v are the heads-views of one projection, as in the model. Each
implementation is timed two ways: ``*_ms`` = `triton.testing.do_bench`
median of the whole call (launches included), ``*_gpu_ms`` = the GPU time of
its kernels (profiler). ``*_err`` = largest |difference| of the forward
output from the float32 per-sample reference. A step runs the op once per
layer (4 at the preset).

    python -m benchmarks run cross-attention            # one GPU, ~1 minute
    python -m benchmarks run cross-attention --smoke    # seconds on the CPU: the reference only

Parameters (``[params]``): ``preset``, ``batch_sizes``, ``impls`` (of
``varlen``, ``triton``, ``reference``), ``seed``.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch

from freescale.kernels.attention.cross import cross_attention_reference
from freescale.models.attention import jagged_attention

from .kernels import gpu_kernel_ms, time_fast
from .runner import Ctx, Result
from .scenario import Scenario

DEFAULTS = {"preset": "h200-21k", "batch_sizes": [128, 32], "impls": ["varlen", "triton"],
            "seed": 0, "max_uih": None}  # fmt: skip


def lengths_of(preset: str, batch: int, seed: int, max_uih: int | None = None):
    """(UIH lengths, candidates per sample, heads, head dim) of one batch drawn
    like the preset's synthetic data (`SyntheticSource.raw_sample`'s draws)."""
    from freescale.config import PRESETS

    cfg = PRESETS[preset]()
    synthetic, _ = cfg.data.synthetic_configs(seed)
    rng = np.random.default_rng(seed)
    cap = synthetic.max_uih if max_uih is None else max_uih
    uih = np.minimum(synthetic.lengths.sample(rng, batch), cap)
    cands = rng.integers(1, synthetic.max_candidates + 1, batch)
    options = cfg.model.options
    return uih.tolist(), cands.tolist(), options["heads"], options["dim"] // options["heads"]


def inputs(uih: list[int], cands: list[int], heads: int, dim: int, dev: str, dtype):
    """q [C, H, D] and k, v [T, H, D]: heads-views of one [rows, 3, H, D] projection each."""
    g = torch.Generator(device=dev).manual_seed(0)
    k_off = torch.tensor([0, *np.cumsum(uih).tolist()], device=dev)
    q_off = torch.tensor([0, *np.cumsum(cands).tolist()], device=dev)
    kv = torch.randn(int(k_off[-1]), 3, heads, dim, device=dev, generator=g, dtype=dtype)
    qp = torch.randn(int(q_off[-1]), 3, heads, dim, device=dev, generator=g, dtype=dtype)
    return qp[:, 0], kv[:, 1], kv[:, 2], q_off, k_off


def call(impl: str, q, k, v, q_off, k_off, max_q: int, max_k: int) -> torch.Tensor:
    if impl == "reference":
        return cross_attention_reference(q, k, v, q_off, k_off)
    return jagged_attention(q, k, v, q_off, k_off, False, max_q, max_k, impl=impl)


def fwd_bwd(impl: str, tensors, maxima) -> Callable[[], None]:
    q, k, v, q_off, k_off = tensors
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    grad = torch.randn_like(q)

    def step() -> None:
        out = call(impl, *leaves, q_off, k_off, *maxima)
        torch.autograd.grad(out, leaves, grad)

    return step


def measure(s: Scenario, ctx: Ctx) -> Result:
    args = SimpleNamespace(**{**DEFAULTS, **s.params})
    dev = "cuda" if s.device == "cuda" and torch.cuda.is_available() else "cpu"
    impls = list(args.impls) if dev == "cuda" else ["reference"]
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    rows = []
    for batch in args.batch_sizes:
        uih, cands, heads, dim = lengths_of(args.preset, batch, args.seed, args.max_uih)
        tensors = inputs(uih, cands, heads, dim, dev, dtype)
        maxima = (max(cands), max(uih))
        row = {"preset": args.preset, "batch_size": batch, "uih_tokens": sum(uih),
               "candidates": sum(cands), "heads": heads, "head_dim": dim}  # fmt: skip
        want = call("reference", *(t.float() for t in tensors[:3]), *tensors[3:], *maxima)
        for impl in impls:
            step = fwd_bwd(impl, tensors, maxima)
            row[f"{impl}_ms"] = round(time_fast(step, dev), 4)
            if dev == "cuda":
                row[f"{impl}_gpu_ms"] = round(gpu_kernel_ms(step, reps=10)[0], 4)
            out = call(impl, *tensors[:3], *tensors[3:], *maxima)
            row[f"{impl}_err"] = float((out.float() - want).abs().max())
        if "varlen_ms" in row and "triton_ms" in row:
            row["speedup"] = round(row["varlen_ms"] / row["triton_ms"], 2)
        rows.append(row)
        print(row, flush=True)
        del tensors
        if dev == "cuda":
            torch.cuda.empty_cache()
    keys = [k for k in rows[0] if k not in ("preset",)] if rows else []
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    table += ["| " + " | ".join(str(r.get(k, "-")) for k in keys) + " |" for r in rows]
    sections = [
        f"One layer's cross-attention, forward + backward, {dtype} on {dev}; "
        "a training step runs it once per layer.", "", *table,
    ]  # fmt: skip
    return Result(rows, sections)
