"""Causal self-attention through cuDNN's SDPA graphs (an optional backend).

`freescale.models.attention` runs the UIH self-attention here when
``model.attention=cudnn``, or ``auto`` on an sm90+ GPU where the
``nvidia-cudnn-frontend`` package imports (``pip install 'freescale[cudnn]'``);
the candidate cross-attention stays on varlen. Measured on one H200 (bf16,
4 heads of 64, the h200-21k preset's 32-sample batch, 140,488 tokens):
fwd+bwd 3.59 ms vs 5.13 ms for FlashAttention-2 varlen, the same error
against float32 (benchmarks/results/attention-probe.json, docs/notes/cudnn-attention.md).

The graphs (`freescale.kernels.attention.cudnn_graphs`) take the packed rows as they
are: per-sample int64 ragged offsets and int32 lengths are bound at run time,
so a graph depends only on

- forward: (B, H, D, S_cap, q/k/v token stride, dtype, device), ``S_cap`` =
  the longest sample rounded up to a multiple of `S_ALIGN` (a graph declared
  for a longer S serves shorter samples at no measured cost: 0.968 vs 0.959 ms)
  and B padded with empty samples to a multiple of `B_ALIGN` (variable local
  batch sizes, `balance.counts=variable`, would otherwise build a graph per B);
- backward: the same and ``T_cap`` = the batch's rows rounded up to a 1/8
  octave (`token_cap`). It is the backward's ``max_total_seq_len_q/kv``,
  which the frontend documents as "the maximum number of query sequence
  tokens for all batches, used for workspace allocation": it sizes the dQ
  accumulator and softmax-sum workspace to ``T_cap`` packed rows (not B·S);
  the kernels address rows through the ragged offsets, so a graph built for
  ``T_cap`` is valid for any batch of at most ``T_cap`` rows (never more: the
  workspace would be too small). A 1/8 octave keeps the graphs few and wastes
  at most 1/8 of that workspace.

Rows: o, dq, dk and dv of every row inside a sample are written (each causal
query sees at least its own key); rows outside every sample (padding) do not
exist in the model's packed layout, and `attention._cudnn` masks them like the
varlen path if a caller pads. q, k, v that are three views of one
``(T, 3·H·D)`` projection (the model's ``qkv(x).chunk(3)``) are read in place
(token stride 3·H·D, dq/dk/dv written in the same layout); other q, k, v are
made contiguous. ``PACKED_QKV = False`` forces the copies (an A/B knob).

Handles: one per device, set to torch's current stream before every execute
(`cudnn.set_stream` is a no-op when it did not change), so the kernels order
with torch's like any other. The workspace of an execute comes from torch's
caching allocator on that stream (its size is read once per graph): memory
stays torch's to reuse, and two streams never share a buffer. Graphs are built
eagerly in the forward (the backward's too when a gradient is needed), on the
calling thread; at most `MAX_GRAPHS` of each direction are kept per device.

Not captured in CUDA graphs: ``dense.graphs=true`` runs varlen inside its
graphs (`freescale.pipeline.graphs`).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

import torch
from torch import Tensor

from freescale.kernels.attention.cudnn_graphs import (
    BWD_DATA,
    FWD_DATA,
    GraphSpec,
    check_roles,
    declare_backward,
    declare_forward,
    offset_units,
)

S_ALIGN = 1024  # S_cap granularity (tokens)
B_ALIGN = 8  # samples are padded with empty ones up to a multiple of this
MAX_HEAD_DIM = 256  # cuDNN's bound for bf16/fp16 SDPA on Hopper
MAX_GRAPHS = 128  # per device and direction (LRU)
MIN_CAPABILITY = (9, 0)  # ragged (THD) SDPA below cuDNN 9.18.1 needs sm90+
INSTALL = "pip install 'freescale[cudnn]'"
PACKED_QKV = True  # read views of one qkv projection in place (False: contiguous copies)
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class Unsupported(ValueError):
    """cuDNN would not build a graph for this attention (one line; `auto` falls back)."""


# ---- availability -----------------------------------------------------------------------
_module: Any = None  # the imported frontend; False after a failed import
_import_error = ""


def import_cudnn() -> Any:
    """The ``cudnn`` frontend module, or None (why: `import_error`). Imported
    once, after torch (whose libcudnn it then finds loaded)."""
    global _module, _import_error
    if _module is None:
        try:
            import cudnn

            cudnn.backend_version()  # the backend library loads
            _module = cudnn
        except Exception as e:  # ImportError, or an OSError of its libraries
            _module, _import_error = False, f"{type(e).__name__}: {_first_line(e)}"
    return _module or None


def import_error() -> str:
    return _import_error


def head_dim_problem(head_dim: int) -> str | None:
    """Why cuDNN SDPA cannot take this head dim (bf16/fp16 on Hopper), or None."""
    if head_dim < 8 or head_dim % 8 or head_dim > MAX_HEAD_DIM:
        return f"a head dim that is a multiple of 8 and at most {MAX_HEAD_DIM} (got {head_dim})"
    return None


def package_problem() -> str | None:
    if import_cudnn() is None:
        return f"the nvidia-cudnn-frontend package ({INSTALL})"
    return None


@cache
def _unavailable(device_type: str, index: int, head_dim: int) -> str | None:
    if device_type != "cuda":
        return "a CUDA device"
    why = head_dim_problem(head_dim) or package_problem()
    if why:
        return why
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(index)
        return f"an sm90+ GPU ({name} is sm{major}{minor})"
    return None


def unavailable(device: torch.device, head_dim: int) -> str | None:
    """What this causal self-attention on ``device`` lacks for cuDNN ("an sm90+
    GPU", "the nvidia-cudnn-frontend package (...)"), or None when it can run
    there. Cached per (device, head dim); `reset` forgets."""
    index = device.index
    if device.type == "cuda" and index is None:
        index = torch.cuda.current_device()
    return _unavailable(device.type, -1 if index is None else index, head_dim)


def reset() -> None:
    """Forget the import, the availability answers and every graph (tests)."""
    global _module, _import_error
    _module, _import_error = None, ""
    _unavailable.cache_clear()
    CACHE.clear()


# ---- sizes --------------------------------------------------------------------------------
def seq_cap(max_len: int) -> int:
    """S of the graphs: the longest sample rounded up to a multiple of `S_ALIGN`."""
    return max(S_ALIGN, -(-max_len // S_ALIGN) * S_ALIGN)


def token_cap(rows: int) -> int:
    """``max_total_seq_len`` of the backward graph: ``rows`` rounded up to
    ``m · 2**e`` with ``8 <= m <= 16`` (at most 1/8 more; ``rows`` itself below 16)."""
    n = max(rows, 1)
    step = 1 << max(n.bit_length() - 4, 0)
    return -(-n // step) * step


# ---- one jagged layout, as the graphs read it ---------------------------------------------
@dataclass(eq=False)
class Ragged:
    """A batch's jagged layout as cuDNN reads it, built once per forward and
    shared by every layer (as `attention.Segments` is): lengths, and the
    token offsets scaled to element offsets per row layout (cached). The
    samples are padded with empty ones up to a multiple of `B_ALIGN` (on the
    device, no host read): ``samples`` counts them."""

    offsets: Tensor  # int64 [B + 1]
    max_len: int  # the longest sample (host int)
    fallback: bool = False  # chosen by `auto`: a graph cuDNN refuses falls back to varlen
    seq_len: Tensor = field(init=False)  # int32 [B, 1, 1, 1]
    _scaled: dict[int, Tensor] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        offsets = self.offsets.to(torch.int64)
        pad = -(offsets.numel() - 1) % B_ALIGN
        if pad and offsets.numel() > 1:
            offsets = torch.cat([offsets, offsets[-1:].expand(pad)])
        self.offsets = offsets
        self.seq_len = (self.offsets[1:] - self.offsets[:-1]).to(torch.int32).view(-1, 1, 1, 1)

    @property
    def samples(self) -> int:
        return self.offsets.numel() - 1

    def scaled(self, unit: int) -> Tensor:
        """int64 [B + 1, 1, 1, 1]: each sample's first element in a row layout
        of ``unit`` elements per token."""
        out = self._scaled.get(unit)
        if out is None:
            out = self._scaled[unit] = (self.offsets * unit).view(-1, 1, 1, 1)
        return out

    def tensors(self) -> list[Tensor]:
        return [self.seq_len, *self._scaled.values()]


# ---- graphs ---------------------------------------------------------------------------------
class Plan:
    """One built graph: its tensors by role, workspace size, engine."""

    def __init__(self, cudnn: Any, handle: Any, lock: threading.Lock, spec: GraphSpec,
                 backward: bool, device: torch.device) -> None:  # fmt: skip
        self.cudnn, self.handle, self.lock, self.spec, self.device = (
            cudnn, handle, lock, spec, device
        )  # fmt: skip
        dt = cudnn.data_type
        self.graph = cudnn.pygraph(
            io_data_type=dt.BFLOAT16 if spec.dtype == "bf16" else dt.HALF,
            intermediate_data_type=dt.FLOAT,
            compute_data_type=dt.FLOAT,
            handle=handle,
        )
        declare = declare_backward if backward else declare_forward
        self.tensors = declare(cudnn, self.graph, spec)
        check_roles(self.tensors, BWD_DATA if backward else FWD_DATA)
        g = self.graph
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.workspace = max(int(g.get_workspace_size()), 1)
        self.units = offset_units(spec)
        self.engine = engine_name(g)

    def run(self, data: dict[str, Tensor], ragged: Ragged) -> None:
        """Execute on torch's current stream of the device (outputs in ``data``)."""
        pack = {self.tensors[role]: x for role, x in data.items()}
        for role, unit in self.units.items():
            pack[self.tensors[role]] = ragged.scaled(unit)
        pack[self.tensors["seq_q"]] = pack[self.tensors["seq_kv"]] = ragged.seq_len
        workspace = torch.empty(self.workspace, dtype=torch.uint8, device=self.device)
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with self.lock:  # one handle per device: its stream and the launch together
            self.cudnn.set_stream(self.handle, stream)
            self.graph.execute(pack, workspace, handle=self.handle)


def engine_name(graph: Any) -> str:
    """Which engine serves a built graph (diagnostics)."""
    try:
        eng = graph.selected_engine
        if eng is not None:
            return f"frost:{eng.name}"
        return str(graph.get_plan_name_at_index(graph._plan_index))
    except Exception as e:  # diagnostics only
        return f"? ({type(e).__name__})"


class GraphCache:
    """Built graphs per device and direction (LRU), the handles, the refusals."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.clear()

    def clear(self) -> None:
        self.plans: dict[tuple[bool, torch.device], OrderedDict[GraphSpec, Plan]] = {}
        self.handles: dict[int, tuple[Any, threading.Lock]] = {}
        self.refused: dict[tuple[bool, torch.device, GraphSpec], str] = {}
        self.builds = 0  # graphs built (a test reads it: a batch under the caps builds none)
        self.build_s = 0.0

    def get(self, spec: GraphSpec, backward: bool, device: torch.device) -> Plan:
        """The graph of ``spec`` on ``device`` (built on first use); `Unsupported`
        when cuDNN refuses it (remembered: not retried)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        plans = self.plans.setdefault((backward, device), OrderedDict())
        plan = plans.get(spec)
        if plan is not None:
            plans.move_to_end(spec)
            return plan
        why = self.refused.get((backward, device, spec))
        if why is not None:
            raise Unsupported(why)
        cudnn = import_cudnn()
        if cudnn is None:
            raise Unsupported(f"model.attention=cudnn needs {package_problem()}")
        t0 = time.perf_counter()
        try:
            plan = self._build(cudnn, spec, backward, device)
        except Exception as e:
            what = "backward" if backward else "forward"
            why = f"cuDNN refused the {what} attention graph {spec}: {_first_line(e)}"
            self.refused[(backward, device, spec)] = why
            raise Unsupported(why) from e
        self.build_s += time.perf_counter() - t0
        self.builds += 1
        plans[spec] = plan
        while len(plans) > MAX_GRAPHS:
            plans.popitem(last=False)
        return plan

    def _build(self, cudnn: Any, spec: GraphSpec, backward: bool, device: torch.device) -> Plan:
        with torch.cuda.device(device):
            handle, lock = self._handle(cudnn, device.index)
            return Plan(cudnn, handle, lock, spec, backward, device)

    def _handle(self, cudnn: Any, index: int) -> tuple[Any, threading.Lock]:
        with self.lock:
            got = self.handles.get(index)
            if got is None:
                got = self.handles[index] = (cudnn.create_handle(), threading.Lock())
            return got

    def engines(self) -> dict[str, list[str]]:
        """Engine of each kept graph, per direction (diagnostics)."""
        out: dict[str, list[str]] = {"forward": [], "backward": []}
        for (backward, _), plans in self.plans.items():
            out["backward" if backward else "forward"] += [p.engine for p in plans.values()]
        return out


CACHE = GraphCache()


# ---- the attention ----------------------------------------------------------------------------
def packed_qkv(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """q, k, v are the three (T, H, D) views of one (T, 3·H·D) tensor, in order."""
    if not PACKED_QKV or not q.shape == k.shape == v.shape:
        return False
    _, h, d = q.shape
    hd, size = h * d, q.element_size()
    if not q.stride() == k.stride() == v.stride() == (3 * hd, d, 1):
        return False
    base = q.data_ptr()
    return (
        k.data_ptr() == base + hd * size
        and v.data_ptr() == base + 2 * hd * size
        and base % 16 == 0
        and q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr()
        and q.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    )


def _dense(x: Tensor) -> Tensor:
    """``x`` contiguous with a 16-byte aligned start (cuDNN's buffers)."""
    x = x.contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def causal_attention(q: Tensor, k: Tensor, v: Tensor, ragged: Ragged) -> Tensor:
    """o [T, H, D]: causal softmax attention within each sample of ``ragged``
    (row i of a sample sees the sample's rows up to i), scale 1/sqrt(D).

    q/k/v: [T, H, D] bf16 or fp16 on an sm90+ GPU, T >= the samples' rows.
    `Unsupported` when cuDNN refuses the graphs (before anything ran)."""
    rows, heads, head_dim = q.shape
    if q.dtype not in DTYPES:
        raise Unsupported(f"cuDNN attention takes bf16 or fp16, got {q.dtype}")
    if rows == 0 or ragged.samples == 0 or ragged.max_len == 0:
        return q.new_zeros(q.shape)  # no row inside a sample
    need_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    packed = packed_qkv(q, k, v)
    spec = GraphSpec(
        ragged.samples, heads, head_dim, seq_cap(ragged.max_len),
        (3 if packed else 1) * heads * head_dim, DTYPES[q.dtype],
    )  # fmt: skip
    try:
        plans = _plans(spec, rows, need_grad, q.device)
    except Unsupported:
        if not packed:
            raise
        # Read in place refused: the probe's layout (contiguous q, k, v) instead.
        q, k, v = _dense(q), _dense(k), _dense(v)
        plans = _plans(replace(spec, token_stride=heads * head_dim), rows, need_grad, q.device)
        packed = False
    return _Attention.apply(q, k, v, ragged, packed, *plans)


def _plans(spec: GraphSpec, rows: int, need_grad: bool, device: torch.device) -> tuple:
    fwd = CACHE.get(spec, False, device)
    bwd = CACHE.get(replace(spec, t_cap=token_cap(rows)), True, device) if need_grad else None
    return fwd, bwd


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, ragged: Ragged, packed: bool,  # type: ignore[override]
                fwd: Plan, bwd: Plan | None) -> Tensor:  # fmt: skip
        if not packed:
            q, k, v = _dense(q), _dense(k), _dense(v)
        rows, heads, _ = q.shape
        o = q.new_empty(q.shape)
        stats = torch.empty((rows, heads, 1), dtype=torch.float32, device=q.device)
        fwd.run({"q": q, "k": k, "v": v, "o": o, "stats": stats}, ragged)
        ctx.save_for_backward(q, k, v, o, stats)
        ctx.ragged, ctx.packed, ctx.bwd = ragged, packed, bwd
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, o, stats = ctx.saved_tensors
        bwd = ctx.bwd
        if bwd is None:  # forward ran without grad mode but a gradient is asked for
            spec = GraphSpec(
                ctx.ragged.samples, q.shape[1], q.shape[2], seq_cap(ctx.ragged.max_len),
                q.stride(0), DTYPES[q.dtype], token_cap(q.shape[0]),
            )  # fmt: skip
            bwd = CACHE.get(spec, True, q.device)
        if ctx.packed:  # dq, dk, dv laid out as q, k, v: views of one (T, 3, H, D)
            dq, dk, dv = q.new_empty((q.shape[0], 3, *q.shape[1:])).unbind(1)
        else:
            dq, dk, dv = (torch.empty_like(x) for x in (q, k, v))
        data = {"q": q, "k": k, "v": v, "o": o, "dO": _dense(grad), "stats": stats}
        bwd.run({**data, "dq": dq, "dk": dk, "dv": dv}, ctx.ragged)
        return dq, dk, dv, None, None, None, None


def warn_fallback(error: Unsupported) -> None:
    """`auto` chose cuDNN, which refused a graph: varlen runs it (said once per graph)."""
    warnings.warn(f"{error}; model.attention=auto runs varlen there", RuntimeWarning, stacklevel=3)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else repr(e)
