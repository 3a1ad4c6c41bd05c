"""Jagged causal self-attention on one GPU: FlashAttention-2 varlen vs cuDNN (issue 32).

The batch is the ``h200-21k`` preset's: 32 samples whose UIH lengths come from
the synthetic source's rule (log-normal, median 4500, sigma 0.55, capped at
17000; sample g draws from ``default_rng([seed, g])``), 4 heads of 64, bf16,
causal within each sample, packed as ``(tokens, heads, 64)``.

Paths, each timed fwd and fwd+bwd (CUDA events, warm-up, median):

- A ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` as
  ``freescale.models.attention`` calls it (the current path, the reference twin);
- B ``cudnn-thd``: the cuDNN frontend's SDPA graphs on the packed layout (THD:
  ragged offsets + padding mask), built once, run through an autograd.Function;
  ``cudnn-thd-cap`` declares S = the length cap instead of the batch's longest,
  what a graph built once for every batch of the preset would run;
- C ``sdpa-cudnn-gN``: torch SDPA with the cuDNN backend on dense batches of N
  samples of similar length (sorted, padded to each group's longest): counts
  the padding and the gather/scatter, reported on the real causal FLOPs.

FLOPs (the issue's convention): fwd = 2 matmuls x 2 FLOPs x head_dim x heads x
sum_i L_i(L_i+1)/2, fwd+bwd = 3.5 x fwd.

Correctness: B and C against A on the batch (max abs and relative difference of
O, dQ, dK, dV) and all three against a float32 reference (plain torch masked
attention, sample by sample); plus two tiny batches, (1, 700, 333) and
(0, 1, 700) -- the second asks whether cuDNN takes a zero-length sample.

    PYTHONPATH=/tmp/site:. python3 scripts/gpu_attention_probe.py      # GPU, ~1-2 min
    PYTHONPATH=. python3 scripts/gpu_attention_probe.py --dry-run      # CPU

``--dry-run`` needs no GPU: it builds the batch, counts FLOPs and padding, checks
the lengths against ``SyntheticSource``, the bucket gather/scatter and the float32
reference (float32 on CPU, when torch is there) and, when ``cudnn`` imports (with
a libcudnn it can load), validates the cuDNN graphs and builds their operation
graphs for sm90 with no device (``--cudnn-cpu-check`` alone does only that; the
frontend wheel is cp312-only, and libcudnn's engine library wants a
libcuda.so.1, which a stub of the cu* symbols it imports satisfies)::

    LD_LIBRARY_PATH=$CUDNN_LIB:$STUB PYTHONPATH=$FRONTEND:. python3.12 \
        scripts/gpu_attention_probe.py --dry-run

The table goes to stdout and, when ``OUT`` is set, to ``$OUT/attention_probe.json``;
``--cudnn-variant padded:int64`` (repeatable) pins the cuDNN layouts tried.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # --cudnn-cpu-check runs where torch is not installed
    torch = None  # type: ignore[assignment]
    F = None  # type: ignore[assignment]

HEADS, HEAD_DIM = 4, 64
SAMPLES, MEDIAN, SIGMA, CAP, MAX_UIH = 32, 4500.0, 0.55, 17000, 21000
FWD_BWD_FACTOR = 3.5  # the issue's convention: bwd = 2.5 x fwd
TINY_BATCHES = {"tiny": [1, 700, 333], "tiny-zero": [0, 1, 700]}
CUDNN_VARIANTS = (("ragged", "int64"), ("ragged", "int32"), ("padded", "int64"))
FWD_ROLES = ("q", "k", "v", "o", "stats")  # buffers bound per call (besides offsets, lengths)
BWD_ROLES = ("q", "k", "v", "o", "dO", "stats", "dq", "dk", "dv")


# ---- the batch (pure python) ------------------------------------------------------------
def sample_lengths(first: int, count: int, seed: int = 0) -> list[int]:
    """UIH lengths of stream positions first..first+count-1, as ``SyntheticSource``
    draws them (``LengthDistribution.sample`` on ``default_rng([seed, g])``, then
    truncation to ``max_uih``)."""
    out = []
    for g in range(first, first + count):
        rng = np.random.default_rng([seed, g])
        raw = np.exp(math.log(MEDIAN) + SIGMA * rng.standard_normal(1))
        full = int(np.clip(np.round(raw), 0, CAP).astype(np.int64)[0])
        out.append(min(full, MAX_UIH))
    return out


def offsets_of(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def causal_pairs(lengths: list[int]) -> int:
    return sum(n * (n + 1) // 2 for n in lengths)


def attention_flops(lengths: list[int], heads: int = HEADS, head_dim: int = HEAD_DIM):
    """(fwd, fwd+bwd) FLOPs of causal attention over ``lengths``."""
    fwd = 4 * head_dim * heads * causal_pairs(lengths)
    return float(fwd), FWD_BWD_FACTOR * fwd


def round_up(n: int, m: int) -> int:
    return max(m, (n + m - 1) // m * m)


def buckets(lengths: list[int], group: int) -> list[list[int]]:
    """Samples sorted by length, in groups of ``group`` (each padded to its longest)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    return [order[i : i + group] for i in range(0, len(order), group)]


def padded_pairs(lengths: list[int], group: int) -> int:
    """Causal pairs a dense kernel computes on the groups (each row of a group padded)."""
    return sum(
        len(g) * max(lengths[i] for i in g) * (max(lengths[i] for i in g) + 1) // 2
        for g in buckets(lengths, group)
    )


def describe_batch(lengths: list[int]) -> dict[str, Any]:
    fwd, both = attention_flops(lengths)
    return {
        "samples": len(lengths),
        "tokens": sum(lengths),
        "max_len": max(lengths),
        "min_len": min(lengths),
        "mean_len": sum(lengths) / len(lengths),
        "causal_pairs": causal_pairs(lengths),
        "fwd_gflop": fwd / 1e9,
        "fwd_bwd_gflop": both / 1e9,
    }


# ---- cuDNN graphs (shared by the GPU run and the CPU check) ---------------------------
def cudnn_layout(b: int, h: int, s: int, d: int, stats: str) -> dict[str, list[int]]:
    """Dims and strides cuDNN is told for packed (T, H, D) tensors.

    A ragged tensor is declared (B, H, S, D) with the strides of a
    (B, S, H, D) tensor -- token stride H*D, head stride D -- and the start of
    sample i given by its ragged offset (elements, i.e. tokens x H x D); S only
    bounds the lengths (the padding mask's seq_len_q/kv hold the real ones).
    Stats (log-sum-exp, float32): ``ragged`` = packed (T, H, 1), token stride H,
    offsets tokens x H; ``padded`` = a dense (B, H, S, 1) tensor, no offsets.
    """
    stats_stride = [s * h, 1, h, 1] if stats == "ragged" else [h * s, s, 1, 1]
    return {
        "dim": [b, h, s, d],
        "stride": [s * h * d, d, h * d, 1],
        "stats_dim": [b, h, s, 1],
        "stats_stride": stats_stride,
    }


@dataclass(frozen=True)
class ThdSpec:
    """What one pair of cuDNN graphs is built for (the lengths are bound at run time)."""

    samples: int
    s: int  # the declared longest sample: S of the (B, H, S, D) dims
    total: int  # packed tokens: the backward's max_total_seq_len_q/kv
    stats: str = "ragged"  # ragged | padded
    offsets: str = "int64"  # int64 | int32


def build_cudnn_graphs(cudnn: Any, make_graph, spec: ThdSpec):
    """Unbuilt forward and backward graphs for causal SDPA on packed q/k/v.

    Returns ((fwd_graph, fwd_tensors), (bwd_graph, bwd_tensors)); the tensors
    dict maps role -> graph tensor: the variant pack's keys.
    """
    dt = cudnn.data_type
    b, stats, total, scale = spec.samples, spec.stats, spec.total, 1 / math.sqrt(HEAD_DIM)
    off_type = dt.INT64 if spec.offsets == "int64" else dt.INT32
    lay = cudnn_layout(b, HEADS, spec.s, HEAD_DIM, stats)
    causal = {
        "diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT,
        "diagonal_band_right_bound": 0,
    }

    offsets = ("q_off", "k_off", "v_off", "o_off") + (("stats_off",) if stats == "ragged" else ())

    def common(g) -> dict[str, Any]:
        t: dict[str, Any] = {}
        for role in offsets:
            t[role] = g.tensor(
                name=role, dim=[b + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=off_type
            )
        for role in ("seq_q", "seq_kv"):
            t[role] = g.tensor(name=role, dim=[b, 1, 1, 1], stride=[1, 1, 1, 1], data_type=dt.INT32)
        for role in ("q", "k", "v"):
            t[role] = g.tensor(
                name=role,
                dim=lay["dim"],
                stride=lay["stride"],
                data_type=dt.BFLOAT16,
                ragged_offset=t[role + "_off"],
            )
        return t

    def packed_out(x, off) -> None:
        x.set_output(True).set_dim(lay["dim"]).set_stride(lay["stride"]).set_ragged_offset(off)

    fwd = make_graph()
    tf = common(fwd)
    o, lse = fwd.sdpa(
        name="sdpa_fwd",
        q=tf["q"],
        k=tf["k"],
        v=tf["v"],
        attn_scale=scale,
        generate_stats=True,
        use_padding_mask=True,
        seq_len_q=tf["seq_q"],
        seq_len_kv=tf["seq_kv"],
        **causal,
    )
    packed_out(o, tf["o_off"])
    lse.set_output(True).set_data_type(dt.FLOAT)
    lse.set_dim(lay["stats_dim"]).set_stride(lay["stats_stride"])
    if stats == "ragged":
        lse.set_ragged_offset(tf["stats_off"])
    tf["o"], tf["stats"] = o, lse

    bwd = make_graph()
    tb = common(bwd)
    tb["o"] = bwd.tensor(
        name="o",
        dim=lay["dim"],
        stride=lay["stride"],
        data_type=dt.BFLOAT16,
        ragged_offset=tb["o_off"],
    )
    tb["dO"] = bwd.tensor(
        name="dO",
        dim=lay["dim"],
        stride=lay["stride"],
        data_type=dt.BFLOAT16,
        ragged_offset=tb["o_off"],
    )
    tb["stats"] = bwd.tensor(
        name="stats",
        dim=lay["stats_dim"],
        stride=lay["stats_stride"],
        data_type=dt.FLOAT,
        ragged_offset=tb["stats_off"] if stats == "ragged" else None,
    )
    dq, dk, dv = bwd.sdpa_backward(
        name="sdpa_bwd",
        q=tb["q"],
        k=tb["k"],
        v=tb["v"],
        o=tb["o"],
        dO=tb["dO"],
        stats=tb["stats"],
        attn_scale=scale,
        use_padding_mask=True,
        seq_len_q=tb["seq_q"],
        seq_len_kv=tb["seq_kv"],
        max_total_seq_len_q=total,
        max_total_seq_len_kv=total,
        **causal,
    )
    for x, off in ((dq, "q_off"), (dk, "k_off"), (dv, "v_off")):
        packed_out(x, tb[off])
    tb["dq"], tb["dk"], tb["dv"] = dq, dk, dv
    return (fwd, tf), (bwd, tb)


def import_cudnn():
    """The cudnn frontend, imported after torch (whose libcudnn it then finds loaded)."""
    import cudnn

    return cudnn


def cudnn_cpu_check(
    cases: dict[str, tuple[list[int], int]], variants=CUDNN_VARIANTS
) -> dict[str, str]:
    """Validate the graphs and build their operation graphs for sm90 without a device.

    Needs ``cudnn`` importable and a libcudnn it can load (its engine library
    wants a libcuda.so.1: a stub exporting cuModuleLoadData & co. will do). The
    frontend lowers to the backend with the handle it creates for the current
    device; with no device, lowering gets none (sm_version/sm_count are given)
    -- a CPU-only patch of a private function. Stops before the heuristics,
    which need a device.
    """
    cudnn = import_cudnn()
    import cudnn._pygraph as pygraph_module

    pygraph_module._default_backend_handle = lambda: None
    print(f"cudnn frontend {cudnn.__version__}, backend {cudnn.backend_version_string()} (CPU)")

    def make_graph():
        return cudnn.pygraph(
            io_data_type=cudnn.data_type.BFLOAT16,
            intermediate_data_type=cudnn.data_type.FLOAT,
            compute_data_type=cudnn.data_type.FLOAT,
            sm_version=90,
            sm_count=132,
        )

    results = {}
    for label, (lengths, s) in cases.items():
        for stats, off in variants:
            key = f"{label}/{stats}-stats/{off}-offsets"
            try:
                spec = ThdSpec(len(lengths), s, max(sum(lengths), 1), stats, off)
                (fg, _), (bg, _) = build_cudnn_graphs(cudnn, make_graph, spec)
                for g in (fg, bg):
                    g.validate()
                    g.build_operation_graph()
                    g._lower_backend_graph()  # private: what create_execution_plans does first
                results[key] = "ok"
            except Exception as e:
                results[key] = f"{type(e).__name__}: {first_line(e)}"
            print(f"  cpu check {key}: {results[key]}")
    return results


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else repr(e)


# ---- GPU paths ---------------------------------------------------------------------------
class Batch:
    """Packed q/k/v/dO of one jagged batch on the GPU (seeded)."""

    def __init__(self, lengths: list[int], seed: int, device: Any) -> None:
        self.lengths = list(lengths)
        self.bounds = offsets_of(self.lengths)
        self.total = self.bounds[-1]
        self.max_len = max(self.lengths)
        self.offsets = torch.tensor(self.bounds, dtype=torch.int64, device=device)
        g = torch.Generator(device=device).manual_seed(seed)
        shape = (self.total, HEADS, HEAD_DIM)

        def randn(grad: bool):
            x = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
            return x.to(torch.bfloat16).requires_grad_(grad)

        self.q, self.k, self.v = randn(True), randn(True), randn(True)
        self.dO = randn(False)


def varlen_path(batch: Batch):
    """Path A: the project's varlen call (``attend`` over a layout built once)."""
    try:
        from freescale.models.attention import attend, attention_layout, segments
    except ImportError:  # run without the project on the path: the same call, inline
        from torch.nn.attention.varlen import varlen_attn

        cu, m = batch.offsets.to(torch.int32), max(batch.max_len, 1)
        return lambda q, k, v: varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0))
    seg = segments(batch.offsets, "varlen", batch.max_len)
    layout = attention_layout(seg, seg, causal=True, num_queries=batch.total)
    return lambda q, k, v: attend(q, k, v, layout)


class CudnnThd:
    """Path B: cuDNN SDPA forward/backward graphs for one batch layout.

    The graphs depend on the number of samples, S (the declared longest) and
    the token total; the lengths and offsets are device tensors bound at run
    time. The first of ``variants`` (stats layout, offset type) whose two graphs
    build is kept; why the others did not is in ``errors``.
    """

    def __init__(
        self, cudnn: Any, handle: Any, lengths: list[int], s: int, variants=CUDNN_VARIANTS
    ) -> None:
        self.cudnn, self.handle = cudnn, handle
        self.lengths, self.s = list(lengths), s
        b, self.total = len(lengths), sum(lengths)
        if max(lengths) > s:
            raise ValueError(f"longest sample {max(lengths)} > declared S {s}")
        self.bounds = torch.tensor(offsets_of(self.lengths), dtype=torch.int64, device="cuda")
        self.seq = torch.tensor(self.lengths, dtype=torch.int32, device="cuda").view(b, 1, 1, 1)
        self.errors: list[str] = []
        t0 = time.perf_counter()
        for stats, off in variants:
            try:
                self._build(ThdSpec(b, s, max(self.total, 1), stats, off))
                break
            except Exception as e:  # try the next layout, keep why
                self.errors.append(f"{stats}/{off}: {type(e).__name__}: {first_line(e)}")
        else:
            raise RuntimeError("no cuDNN graph variant built: " + " | ".join(self.errors))
        self.build_s = time.perf_counter() - t0

    def _make_graph(self):
        dt = self.cudnn.data_type
        return self.cudnn.pygraph(
            io_data_type=dt.BFLOAT16,
            intermediate_data_type=dt.FLOAT,
            compute_data_type=dt.FLOAT,
            handle=self.handle,
        )

    def _build(self, spec: ThdSpec) -> None:
        cudnn = self.cudnn
        (fg, tf), (bg, tb) = build_cudnn_graphs(cudnn, self._make_graph, spec)
        for g in (fg, bg):
            g.validate()
            g.build_operation_graph()
            g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            g.check_support()
            g.build_plans()
        itype = torch.int64 if spec.offsets == "int64" else torch.int32
        b = spec.samples

        def offsets(unit: int):  # ragged offsets in elements: tokens x elements per token
            return (self.bounds * unit).to(itype).view(b + 1, 1, 1, 1)

        tok = offsets(HEADS * HEAD_DIM)
        bound = {"q_off": tok, "k_off": tok, "v_off": tok, "o_off": tok}
        bound.update(seq_q=self.seq, seq_kv=self.seq)
        if spec.stats == "ragged":
            bound["stats_off"] = offsets(HEADS)
        for graph_roles, run_roles in ((tf, FWD_ROLES), (tb, BWD_ROLES)):
            if set(graph_roles) != set(bound) | set(run_roles):  # every operand gets a buffer
                raise RuntimeError(f"roles {sorted(graph_roles)} vs {sorted(bound)} + {run_roles}")
        self.spec, self.bound = spec, bound
        self.fwd, self.tf, self.bwd, self.tb = fg, tf, bg, tb
        self.ws_fwd = torch.empty(max(fg.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
        self.ws_bwd = torch.empty(max(bg.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
        self.engines = (engine_name(fg), engine_name(bg))
        self.variant = f"{spec.stats} stats, {spec.offsets} offsets"

    def _run(self, graph, tensors, data, ws) -> None:
        pack = {tensors[role]: x for role, x in {**self.bound, **data}.items() if role in tensors}
        self.cudnn.set_stream(self.handle, torch.cuda.current_stream().cuda_stream)
        graph.execute(pack, ws, handle=self.handle)

    def forward(self, q, k, v):
        o = torch.empty_like(q)
        if self.spec.stats == "ragged":
            lse = torch.empty(q.shape[0], HEADS, 1, dtype=torch.float32, device=q.device)
        else:
            lse = torch.empty(
                len(self.lengths), HEADS, self.s, 1, dtype=torch.float32, device=q.device
            )
        self._run(self.fwd, self.tf, {"q": q, "k": k, "v": v, "o": o, "stats": lse}, self.ws_fwd)
        return o, lse

    def backward(self, q, k, v, o, lse, do):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        data = {
            "q": q,
            "k": k,
            "v": v,
            "o": o,
            "dO": do,
            "stats": lse,
            "dq": dq,
            "dk": dk,
            "dv": dv,
        }
        self._run(self.bwd, self.tb, data, self.ws_bwd)
        return dq, dk, dv


def engine_name(graph) -> str:
    """Which engine serves a built graph (a python FROST engine or the backend's plan)."""
    try:
        eng = graph.selected_engine
        if eng is not None:
            return f"frost:{eng.name}"
        return graph.get_plan_name_at_index(graph._plan_index)
    except Exception as e:  # diagnostics only
        return f"? ({type(e).__name__})"


def cudnn_path(runner: CudnnThd):
    class _Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):  # type: ignore[override]
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
            o, lse = runner.forward(q, k, v)
            ctx.save_for_backward(q, k, v, o, lse)
            return o

        @staticmethod
        def backward(ctx, do):  # type: ignore[override]
            q, k, v, o, lse = ctx.saved_tensors
            return runner.backward(q, k, v, o, lse, do.contiguous())

    return _Attention.apply


def bucket_path(lengths: list[int], group: int, device: Any, backend: Any = "cudnn"):
    """Path C: dense causal SDPA per group of similar lengths, padded at the end.

    Padding sits after each sample's tokens, so a causal mask alone keeps the
    real rows exact (row i < L sees keys j <= i < L); padded rows are dropped and
    get zero gradient, which then gives the keys they saw zero gradient too.
    Padded slots read token 0 (any finite row would do). ``backend=None``
    lets torch choose (the CPU self-check).
    """
    bounds = offsets_of(lengths)
    plan, taken = [], []
    for grp in buckets(lengths, group):
        pad = max(lengths[i] for i in grp)
        if pad == 0:
            continue
        idx = torch.zeros(len(grp), pad, dtype=torch.int64)
        keep = []
        for r, i in enumerate(grp):
            n = lengths[i]
            idx[r, :n] = torch.arange(bounds[i], bounds[i] + n)
            keep.append(torch.arange(r * pad, r * pad + n))
            taken.append(torch.arange(bounds[i], bounds[i] + n))
        plan.append((idx.view(-1).to(device), torch.cat(keep).to(device), len(grp), pad))
    order = torch.argsort(torch.cat(taken)).to(device) if taken else None

    def attention(q, k, v):
        parts = []
        for idx, keep, n, pad in plan:
            qg, kg, vg = (x[idx].view(n, pad, HEADS, HEAD_DIM).transpose(1, 2) for x in (q, k, v))
            if backend is None:
                o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            else:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            parts.append(o.transpose(1, 2).reshape(n * pad, HEADS, HEAD_DIM)[keep])
        if order is None:
            return torch.zeros_like(q)
        return torch.cat(parts)[order]

    return attention


def reference_fp32(batch_lengths: list[int], q, k, v, do):
    """float32 O, dQ, dK, dV: explicit masked softmax attention, sample by sample."""
    bounds = offsets_of(batch_lengths)
    outs = [torch.zeros(q.shape, dtype=torch.float32, device=q.device) for _ in range(4)]
    scale = 1 / math.sqrt(q.shape[-1])
    for i, n in enumerate(batch_lengths):
        if n == 0:
            continue
        s0, s1 = bounds[i], bounds[i + 1]
        qi, ki, vi = (x[s0:s1].detach().float().transpose(0, 1).requires_grad_() for x in (q, k, v))
        scores = (qi @ ki.transpose(-1, -2)) * scale
        above = torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1)
        p = scores.masked_fill(above, float("-inf")).softmax(-1)
        oi = p @ vi
        grads = torch.autograd.grad(oi, (qi, ki, vi), do[s0:s1].float().transpose(0, 1))
        for dst, src in zip(outs, (oi.detach(), *grads), strict=True):
            dst[s0:s1] = src.transpose(0, 1)
        del scores, p, oi, grads
    return outs


def worst_of(values) -> float:
    """The largest, NaN if any is NaN (max() alone depends on the order then)."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def compare(got, ref) -> dict[str, float]:
    """max |got - ref|, that over max |ref|, and the relative L2 error."""
    got, ref = got.detach().float(), ref.detach().float()
    diff = got - ref
    ref_max = float(ref.abs().max()) if ref.numel() else 0.0
    abs_max = float(diff.abs().max()) if diff.numel() else 0.0
    ref_l2 = float(ref.norm())
    return {
        "max_abs": abs_max,
        "max_rel": abs_max / ref_max if ref_max else abs_max,
        "rel_l2": float(diff.norm()) / ref_l2 if ref_l2 else float(diff.norm()),
        "nonfinite": int((~torch.isfinite(got)).sum()),
    }


def run_once(fn, batch: Batch):
    """O, dQ, dK, dV of one fwd+bwd (detached bf16)."""
    out = fn(batch.q, batch.k, batch.v)
    grads = torch.autograd.grad(out, (batch.q, batch.k, batch.v), batch.dO)
    return [out.detach(), *grads]


def median_ms(call, iters: int, warmup: int) -> float:
    """Median of ``iters`` CUDA-event timings of ``call`` after ``warmup`` calls."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(iters)
    ]
    for start, end in events:
        start.record()
        call()
        end.record()
    torch.cuda.synchronize()
    return statistics.median([start.elapsed_time(end) for start, end in events])


def time_path(fn, batch: Batch, iters: int, warmup: int) -> tuple[float, float]:
    """Median ms of fwd and of fwd+bwd, through autograd as a model runs them."""

    def fwd():
        fn(batch.q, batch.k, batch.v)

    def fwd_bwd():
        out = fn(batch.q, batch.k, batch.v)
        torch.autograd.grad(out, (batch.q, batch.k, batch.v), batch.dO)

    return median_ms(fwd, iters, warmup), median_ms(fwd_bwd, iters, warmup)


def time_raw(runner: CudnnThd, batch: Batch, iters: int, warmup: int) -> tuple[float, float]:
    """Median ms of the bare forward and backward graph executions (outputs
    allocated once, no autograd): what the kernels cost without the wrapper."""
    q, k, v, do = (x.detach() for x in (batch.q, batch.k, batch.v, batch.dO))
    o, lse = runner.forward(q, k, v)
    dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
    fwd = {"q": q, "k": k, "v": v, "o": o, "stats": lse}
    bwd = {**fwd, "dO": do, "dq": dq, "dk": dk, "dv": dv}

    def run_fwd():
        runner._run(runner.fwd, runner.tf, fwd, runner.ws_fwd)

    def run_bwd():
        runner._run(runner.bwd, runner.tb, bwd, runner.ws_bwd)

    return median_ms(run_fwd, iters, warmup), median_ms(run_bwd, iters, warmup)


def attempt(errors: dict[str, str], key: str, fn, *args):
    """fn(*args), or None with the exception's first line printed and kept."""
    try:
        return fn(*args)
    except Exception as e:  # one path failing must not lose the others
        errors[key] = f"{type(e).__name__}: {str(e).strip()[:2000]}"
        print(f"  [{key}] {type(e).__name__}: {first_line(e)}", flush=True)
        return None


def gpu_main(args: argparse.Namespace) -> dict[str, Any]:
    """Every path in turn: build, one checked fwd+bwd, timing; A first and the
    cuDNN graphs last, so that a path that takes the CUDA context down cannot
    cost the numbers before it (the JSON is rewritten after each path)."""
    dev = torch.device("cuda")
    torch.set_float32_matmul_precision("highest")  # the reference: no TF32
    lengths = sample_lengths(args.first, args.samples, args.seed)
    info = describe_batch(lengths)
    fwd_flop, both_flop = attention_flops(lengths)
    report: dict[str, Any] = {
        "batch": info,
        "lengths": lengths,
        "rows": [],
        "checks": {},
        "errors": {},
        "meta": environment(),
    }
    errors = report["errors"]
    print_environment(report["meta"])
    print(
        f"batch: {info['samples']} samples, {info['tokens']} tokens, longest {info['max_len']}, "
        f"fwd {fwd_flop / 1e9:.0f} GFLOP, fwd+bwd {both_flop / 1e9:.0f} GFLOP"
    )
    batch = Batch(lengths, args.seed, dev)
    base: list[Any] = []  # A's O, dQ, dK, dV
    ref: list[Any] = []  # float32 O, dQ, dK, dV

    def measure(name: str, fn, note: str = "", runner: CudnnThd | None = None) -> None:
        row: dict[str, Any] = {
            "path": name,
            "fwd_ms": None,
            "fwd_bwd_ms": None,
            "fwd_tflops": None,
            "fwd_bwd_tflops": None,
            "max_rel_err_vs_fp32": None,
            "note": note,
        }
        report["rows"].append(row)
        if fn is None:
            return
        got = attempt(errors, f"{name} run", run_once, fn, batch)
        if got is not None:
            is_base = name.startswith("A ")
            if is_base:
                base.extend(got)
            entry = {}
            for i, label in enumerate(("O", "dQ", "dK", "dV")):
                entry[label] = {
                    "vs_A": compare(got[i], base[i]) if base and not is_base else None,
                    "vs_fp32": compare(got[i], ref[i]) if ref else None,
                }
            report["checks"][name] = entry
            if ref:
                row["max_rel_err_vs_fp32"] = worst_of(
                    v["vs_fp32"]["max_rel"] for v in entry.values()
                )
        if runner is not None:
            raw = attempt(
                errors, f"{name} bare timing", time_raw, runner, batch, args.iters, args.warmup
            )
            if raw is not None:
                row["raw_fwd_ms"], row["raw_bwd_ms"] = raw
                row["note"] += f" | bare graphs: fwd {raw[0]:.3f} ms, bwd {raw[1]:.3f} ms"
        timed = attempt(errors, f"{name} timing", time_path, fn, batch, args.iters, args.warmup)
        if timed is not None:
            row["fwd_ms"], row["fwd_bwd_ms"] = timed
            row["fwd_tflops"] = fwd_flop / (timed[0] * 1e-3) / 1e12
            row["fwd_bwd_tflops"] = both_flop / (timed[1] * 1e-3) / 1e12
            print(
                f"  {name}: fwd {timed[0]:.3f} ms ({row['fwd_tflops']:.0f} TFLOP/s), "
                f"fwd+bwd {timed[1]:.3f} ms ({row['fwd_bwd_tflops']:.0f} TFLOP/s)",
                flush=True,
            )
        write_json(report, quiet=True)

    # A: the current path, the reference twin of the others.
    measure("A varlen (FA2)", attempt(errors, "A build", varlen_path, batch))
    if not args.no_ref:
        t0 = time.perf_counter()
        got = attempt(
            errors, "fp32 reference", reference_fp32, lengths, batch.q, batch.k, batch.v, batch.dO
        )
        ref.extend(got or [])
        print(f"  fp32 reference: {time.perf_counter() - t0:.1f}s", flush=True)
        if ref and "A varlen (FA2)" in report["checks"]:  # A ran before the reference existed
            entry = report["checks"]["A varlen (FA2)"]
            for i, label in enumerate(("O", "dQ", "dK", "dV")):
                entry[label]["vs_fp32"] = compare(base[i], ref[i])
            report["rows"][0]["max_rel_err_vs_fp32"] = worst_of(
                v["vs_fp32"]["max_rel"] for v in entry.values()
            )

    # C: torch SDPA (cuDNN backend) on length buckets.
    for g in args.groups:
        name = f"C sdpa-cudnn-g{g}"
        note = f"padding x{padded_pairs(lengths, g) / causal_pairs(lengths):.3f} pairs"
        measure(name, attempt(errors, f"{name} build", bucket_path, lengths, g, dev), note)

    # B: the cuDNN frontend's graphs on the packed layout.
    cudnn = attempt(errors, "cudnn import", import_cudnn)
    handle = attempt(errors, "cudnn handle", cudnn.create_handle) if cudnn else None
    caps = {
        "B cudnn-thd": round_up(info["max_len"], args.s_align),
        "B cudnn-thd-cap": round_up(min(CAP, MAX_UIH), args.s_align),
    }
    for name, s in caps.items():
        if handle is None:
            measure(name, None, "cudnn unavailable")
            continue
        runner = attempt(
            errors, f"{name} build", CudnnThd, cudnn, handle, lengths, s, args.cudnn_variants
        )
        if runner is None:
            measure(name, None, f"S={s}, no graph built")
            continue
        note = (
            f"S={s}, {runner.variant}, build {runner.build_s:.1f}s, "
            f"engines fwd={runner.engines[0]} bwd={runner.engines[1]}"
        )
        if runner.errors:
            note += " | failed variants: " + " | ".join(runner.errors)
        print(f"  {name}: {note}", flush=True)
        measure(name, cudnn_path(runner), note, runner)
    print_checks(report["checks"])
    base.clear()
    ref.clear()

    # Tiny batches: zero-length samples and short ones, all paths vs float32.
    report["tiny"] = {}
    for label, tiny_lengths in ({} if args.no_tiny else TINY_BATCHES).items():
        report["tiny"][label] = attempt(
            errors, f"{label} check", tiny_check, tiny_lengths, args, cudnn, handle, dev
        )
    return report


def tiny_check(lengths: list[int], args, cudnn, handle, dev) -> dict[str, Any]:
    batch = Batch(lengths, args.seed + 1, dev)
    ref = reference_fp32(lengths, batch.q, batch.k, batch.v, batch.dO)
    out: dict[str, Any] = {"lengths": lengths}
    paths = {"A varlen (FA2)": lambda: varlen_path(batch)}
    if handle is not None:
        s_tiny = round_up(max(lengths), args.s_align)

        def make_b():
            runner = CudnnThd(cudnn, handle, lengths, s_tiny, args.cudnn_variants)
            out["B variant"] = runner.variant + (
                " | " + " | ".join(runner.errors) if runner.errors else ""
            )
            return cudnn_path(runner)

        paths["B cudnn-thd"] = make_b
    paths["C sdpa-cudnn-g4"] = lambda: bucket_path(lengths, 4, dev)
    for name, make in paths.items():
        try:
            got = run_once(make(), batch)
            out[name] = {
                t: compare(x, r) for t, x, r in zip(("O", "dQ", "dK", "dV"), got, ref, strict=True)
            }
            worst = worst_of(v["max_rel"] for v in out[name].values())
            bad = sum(v["nonfinite"] for v in out[name].values())
            summary = f"max rel {worst:.2e}" + (f", {bad} non-finite" if bad else "")
            if name.startswith("B"):
                summary += f" ({out.get('B variant')})"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {first_line(e)}"
            summary = out[name]
        print(f"  tiny {lengths} {name}: {summary}")
    return out


# ---- reporting ---------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    meta: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    if torch.cuda.is_available():
        meta["device"] = torch.cuda.get_device_name()
        meta["capability"] = list(torch.cuda.get_device_capability())
        meta["torch_cudnn"] = torch.backends.cudnn.version()
    try:
        cudnn = import_cudnn()
        meta["cudnn_frontend"] = cudnn.__version__
        meta["cudnn_backend"] = cudnn.backend_version_string()
        meta["cudnn_module"] = os.path.dirname(cudnn.__file__)
    except Exception as e:
        meta["cudnn_frontend"] = f"unavailable: {type(e).__name__}: {first_line(e)}"
    return meta


def print_environment(meta: dict[str, Any]) -> None:
    print(" ".join(f"{k}={v}" for k, v in meta.items()))


def print_checks(checks: dict[str, Any]) -> None:
    print("correctness on the batch (max_rel = max|x - ref| / max|ref|):")
    for name, entry in checks.items():
        for against in ("vs_A", "vs_fp32"):
            cells = []
            for t, v in entry.items():
                if v[against] is not None:
                    c = v[against]
                    bad = f" NONFINITE={c['nonfinite']}" if c["nonfinite"] else ""
                    cells.append(
                        f"{t} abs {c['max_abs']:.2e} rel {c['max_rel']:.2e} "
                        f"l2 {c['rel_l2']:.2e}{bad}"
                    )
            if cells:
                print(f"  {name:20s} {against:8s} " + " | ".join(cells))


def fmt(x: float | None, spec: str) -> str:
    """``x`` formatted by ``spec`` ("8.3f"), or "-" as wide."""
    return "-".rjust(int(spec.split(".")[0])) if x is None else format(x, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'path':22s} {'fwd ms':>8s} {'f+b ms':>8s} {'fwd TF/s':>9s} {'f+b TF/s':>9s} "
        f"{'rel err fp32':>12s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['path']:22s} {fmt(r['fwd_ms'], '8.3f')} {fmt(r['fwd_bwd_ms'], '8.3f')} "
            f"{fmt(r['fwd_tflops'], '9.1f')} {fmt(r['fwd_bwd_tflops'], '9.1f')} "
            f"{fmt(r['max_rel_err_vs_fp32'], '12.2e')}"
        )
    for r in rows:
        if r["note"]:
            print(f"  {r['path']}: {r['note']}")


def print_targets(lengths: list[int]) -> None:
    """The issue's numbers as milliseconds on this batch."""
    fwd, both = attention_flops(lengths)
    for label, tflops, flop in (
        ("FA2 fwd as in the issue", 267, fwd),
        ("FA2 fwd+bwd as in the issue", 246, both),
        ("target fwd+bwd", 380, both),
    ):
        print(f"  {label}: {tflops} TFLOP/s = {flop / (tflops * 1e12) * 1e3:.3f} ms on this batch")


def write_json(report: dict[str, Any], quiet: bool = False) -> None:
    out = os.environ.get("OUT")
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "attention_probe.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=1, default=str)
    if not quiet:
        print(f"wrote {path}")


# ---- CPU ---------------------------------------------------------------------------------
def dry_run(args: argparse.Namespace) -> dict[str, Any]:
    lengths = sample_lengths(args.first, args.samples, args.seed)
    info = describe_batch(lengths)
    report: dict[str, Any] = {"batch": info, "lengths": lengths, "checks": {}}
    print(f"batch: {json.dumps(info)}")
    print(f"lengths: {lengths}")
    print_targets(lengths)
    for g in args.groups:
        waste = padded_pairs(lengths, g) / causal_pairs(lengths)
        print(f"  groups of {g}: dense causal work x{waste:.3f}")
    s = round_up(info["max_len"], args.s_align)
    lay = cudnn_layout(len(lengths), HEADS, s, HEAD_DIM, "ragged")
    tok = [o * HEADS * HEAD_DIM for o in offsets_of(lengths)]
    print(
        f"  cuDNN q/k/v/o dim {lay['dim']} stride {lay['stride']}, "
        f"offsets[:4] {tok[:4]} ... {tok[-1]} (= tokens x H x D)"
    )
    report["checks"]["source_lengths"] = check_source_lengths(args, lengths)
    if torch is not None:
        report["checks"]["cpu_numerics"] = cpu_numerics()
    else:
        print("  torch not importable: numerics self-check skipped")
    try:
        cases = {
            "batch": (lengths, s),
            "batch-cap": (lengths, round_up(min(CAP, MAX_UIH), args.s_align)),
        }
        for label, tiny in TINY_BATCHES.items():
            cases[label] = (tiny, round_up(max(tiny), args.s_align))
        report["checks"]["cudnn_cpu"] = cudnn_cpu_check(cases, args.cudnn_variants)
    except ImportError as e:
        print(f"  cudnn not importable ({first_line(e)}): graph check skipped")
    return report


def check_source_lengths(args: argparse.Namespace, lengths: list[int]) -> str:
    """The lengths equal the h200-21k preset's synthetic source's (when importable)."""
    try:
        from freescale.config import h200_21k
        from freescale.data.synthetic import SyntheticSource
    except ImportError as e:
        print(f"  freescale not importable ({first_line(e)}): source check skipped")
        return "skipped"
    synthetic, _ = h200_21k().data.synthetic_configs(seed=args.seed)
    source = SyntheticSource(synthetic)
    got = [source.raw_sample(g).uih_ids.size for g in range(args.first, args.first + 4)]
    verdict = "ok" if got == lengths[:4] else f"MISMATCH source {got} vs {lengths[:4]}"
    print(f"  lengths vs SyntheticSource (first 4): {verdict}")
    return verdict


def cpu_numerics() -> dict[str, Any]:
    """float32 on CPU: the bucketed gather/scatter and the reference against the
    project's per-sample reference (outputs) and each other (gradients)."""
    out: dict[str, Any] = {}
    lengths = [0, 1, 70, 33, 5, 0, 64]
    bounds = torch.tensor(offsets_of(lengths))
    g = torch.Generator().manual_seed(0)
    shape = (sum(lengths), HEADS, HEAD_DIM)
    q, k, v, do = (torch.randn(shape, generator=g) for _ in range(4))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    ref = reference_fp32(lengths, q, k, v, do)
    try:
        from freescale.models.attention import reference_attention

        proj = reference_attention(q.detach(), k.detach(), v.detach(), bounds, bounds, True)
        out["reference_vs_project"] = compare(ref[0], proj)["max_abs"]
    except ImportError:
        out["reference_vs_project"] = None
    for group in (2, 4):
        fn = bucket_path(lengths, group, "cpu", backend=None)
        o = fn(q, k, v)
        grads = torch.autograd.grad(o, (q, k, v), do)
        out[f"bucket_g{group}_vs_reference"] = max(
            compare(x, r)["max_abs"] for x, r in zip((o, *grads), ref, strict=True)
        )
    print(f"  cpu numerics (max abs, float32): {json.dumps(out)}")
    bad = [k for k, v in out.items() if v is not None and v > 1e-4]
    if bad:
        raise SystemExit(f"cpu numerics failed: {bad}")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="CPU only: batch, FLOPs, self-checks")
    p.add_argument(
        "--cudnn-cpu-check",
        action="store_true",
        help="only validate the cuDNN graphs for sm90 without a device",
    )
    p.add_argument("--samples", type=int, default=SAMPLES)
    p.add_argument("--first", type=int, default=0, help="stream position of the first sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--groups", type=int, nargs="*", default=[4, 8], help="path C group sizes")
    p.add_argument("--s-align", type=int, default=64, help="cuDNN S = longest rounded up to this")
    p.add_argument("--no-ref", action="store_true", help="skip the float32 reference on the batch")
    p.add_argument("--no-tiny", action="store_true", help="skip the tiny-batch checks")
    p.add_argument(
        "--cudnn-variant",
        dest="cudnn_variants",
        action="append",
        type=lambda x: tuple(x.split(":")),
        help="stats:offsets to try, in order (default: "
        + ", ".join(":".join(v) for v in CUDNN_VARIANTS)
        + ")",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.cudnn_variants = tuple(args.cudnn_variants or CUDNN_VARIANTS)
    for stats, off in args.cudnn_variants:
        if stats not in ("ragged", "padded") or off not in ("int64", "int32"):
            raise SystemExit(f"--cudnn-variant wants ragged|padded:int64|int32, got {stats}:{off}")
    if args.cudnn_cpu_check:
        lengths = sample_lengths(args.first, args.samples, args.seed)
        s = round_up(max(lengths), args.s_align)
        cudnn_cpu_check({"batch": (lengths, s)}, args.cudnn_variants)
        return
    if args.dry_run:
        write_json({"dry_run": dry_run(args)})
        return
    if torch is None or not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (or --dry-run)")
    report = gpu_main(args)
    print()
    print_table(report["rows"])
    print_targets(report["lengths"])
    write_json(report)


if __name__ == "__main__":
    main()
