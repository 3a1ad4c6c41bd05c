"""Fused jagged HSTU attention: the op, its bucket scheme and its torch twin.

For each sample (``L`` history rows, ``C`` candidates) and head, with
``α = head_dim^-1/2`` and ``N = L + 1``::

    history row i:   out_i = (1/N) Σ_{j ≤ i} SiLU(α·q_i·k_j + rab(i - j, t_i - t_j))·v_j
    candidate c:     out_c = (1/N) Σ_{j < L} SiLU(α·q_c·k_j + rab(L - j, t_c - t_j))·v_j

``rab(p, dt) = P[bucket(|p|)] + T[bucket(|dt|)]`` from two small tables
(`POSITION`, `TIME`; no bias when the tables are None). A candidate's
attention to itself is not included: it is one elementwise term, the
caller's (`freescale.models.hstu_attention`).

`hstu_attention` runs the Triton kernels (`triton_hstu_fwd`, `triton_hstu_bwd`) on the
packed rows: no padding, no ``[L, L]`` tensor, memory linear in the tokens,
q/k/v read in place from strided views. `reference` is the twin: a loop over
samples, written out in float32. `Schedule` is the per-batch part (block
tables, sample order), built once per forward and shared by every layer.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from freescale.kernels.backend import triton_module


@dataclass(frozen=True)
class Buckets:
    """``x`` below ``exact`` gets its own bucket, then ``per_octave`` per doubling;
    the last of ``count`` buckets holds the rest."""

    exact: int
    per_octave: int  # 1 or 2 (the kernel's integer form)
    count: int

    @property
    def cap(self) -> int:
        """Values from here on all land in the last bucket (a clamp that keeps
        ``cap^per_octave`` inside int32)."""
        return self.exact * 2 ** math.ceil((self.count - 1 - self.exact) / self.per_octave)

    def of(self, x: int) -> int:
        """The bucket of one int ``x >= 0`` (`log_buckets` on Python ints)."""
        x = min(x, self.cap)
        if x < self.exact:
            return x
        octaves = (x**self.per_octave // self.exact**self.per_octave).bit_length() - 1
        return min(self.exact + octaves, self.count - 1)

    def starts(self) -> list[int]:
        """The first value of each bucket (the kernel's boundaries)."""
        out = []
        for b in range(self.count):
            lo, hi = 0, self.cap  # smallest x with of(x) >= b: of is monotone
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (mid + 1, hi) if self.of(mid) < b else (lo, mid)
            out.append(lo)
        return out


# Relative position: 0..7 exactly, then 2 buckets per doubling up to 8·2^12.
POSITION = Buckets(exact=8, per_octave=2, count=32)
# Relative time (the timestamps' unit, seconds for the built-in sources):
# 0, then one bucket per doubling up to 2^30 s.
TIME = Buckets(exact=1, per_octave=1, count=32)


def log_buckets(x: Tensor, b: Buckets) -> Tensor:
    """Bucket of each ``|x|`` (int32), in exact integer arithmetic:
    ``exact + floor(per_octave·log2(|x|/exact))`` = ``exact + floor(log2(⌊|x|^p / exact^p⌋))``
    (floor(log2) of a real >= 1 is that of its floor), read off float64's
    exponent, which is exact for these integers. The kernel computes the same."""
    x = x.abs().clamp(max=b.cap).to(torch.int64)
    y = (x**b.per_octave) // (b.exact**b.per_octave)
    _, exponent = torch.frexp(y.clamp(min=1).to(torch.float64))
    far = (b.exact + exponent.to(torch.int64) - 1).clamp(max=b.count - 1)
    return torch.where(x < b.exact, x, far).to(torch.int32)


# (BLOCK_M, BLOCK_N, warps, stages) tried per kernel; the first is the default
# (the interpreter, CUDA graph capture). BLOCK_M: query rows, BLOCK_N: keys.
CONFIGS = {
    "fwd": (
        (128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 32, 4, 3),
        (128, 32, 4, 4), (64, 64, 4, 4),
    ),
    "dq": (
        (128, 64, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4), (128, 64, 4, 2),
        (128, 128, 8, 2),
    ),
    "dkdv": (
        (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 3), (64, 128, 4, 2),
        (128, 128, 8, 2), (32, 128, 8, 4),
    ),
}  # fmt: skip
_TUNED: dict[tuple, tuple[int, int, int, int]] = {}
_STARTS: dict[torch.device, tuple[Tensor, Tensor]] = {}


def _starts(device: torch.device) -> tuple[Tensor, Tensor]:
    """Bucket boundaries on ``device``: position int32, time int64."""
    if device not in _STARTS:
        _STARTS[device] = (
            torch.tensor(POSITION.starts(), dtype=torch.int32, device=device),
            torch.tensor(TIME.starts(), dtype=torch.int64, device=device),
        )
    return _STARTS[device]


@dataclass
class Schedule:
    """The batch's blocks, dealt longest sample first (built once per forward)."""

    uih_offsets: Tensor  # int64 [B + 1]
    cand_offsets: Tensor  # int64 [B + 1]
    n_uih: int
    n_cand: int
    order: Tensor = field(init=False)  # int32 [B]: samples, longest history first
    _blocks: dict = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.uih_len = self.uih_offsets.diff()
        self.cand_len = self.cand_offsets.diff()
        self.order = torch.argsort(self.uih_len, descending=True, stable=True)
        self.batch = self.uih_offsets.numel() - 1

    def blocks(self, rows: str, size: int) -> tuple[Tensor, int]:
        """(first block of each dealt sample, int32 [B + 1]; grid bound) for blocks of
        ``size`` rows over ``rows``: "all" (history + candidates), "cand", "keys"."""
        key = (rows, size)
        if key not in self._blocks:
            lengths = {
                "all": self.uih_len + self.cand_len,
                "cand": self.cand_len,
                "keys": self.uih_len,
            }[rows][self.order]
            total = {"all": self.n_uih + self.n_cand, "cand": self.n_cand, "keys": self.n_uih}
            counts = (lengths + size - 1) // size
            start = torch.zeros(self.batch + 1, dtype=torch.int32, device=lengths.device)
            start[1:] = counts.cumsum(0)
            self._blocks[key] = (start, -(-total[rows] // size) + self.batch)
        return self._blocks[key]

    def tune_key(self) -> tuple[int, int]:
        """Shape bucket for tuning: octaves of the tokens and of the mean history."""
        rows = self.n_uih + self.n_cand
        return rows.bit_length(), (self.n_uih // max(1, self.batch)).bit_length()


def _interpreting(kernel: object) -> bool:
    return triton_module("common").interpreted(kernel)


def _pick(kind: str, key: tuple, launch, interpreted: bool) -> tuple[int, int, int, int]:
    """The fastest of ``CONFIGS[kind]`` for ``key`` (timed once per process); the
    first under deterministic algorithms (a config changes the summation order,
    and timings differ between processes) and where nothing can be timed."""
    first = CONFIGS[kind][0]
    if torch.are_deterministic_algorithms_enabled():
        return first
    if interpreted or torch.cuda.is_current_stream_capturing():
        return _TUNED.get((kind, *key), first)
    if (kind, *key) not in _TUNED:
        bench = triton_module("common").bench_ms
        times = []
        for cfg in CONFIGS[kind]:
            try:
                times.append((bench(lambda c=cfg: launch(c), warmup=3, rep=15), cfg))
            except Exception:  # a config this GPU cannot run (shared memory, registers)
                continue
        _TUNED[(kind, *key)] = min(times)[1] if times else first
    return _TUNED[(kind, *key)]


def _strides(*ts: Tensor) -> list[int]:
    out = []
    for t in ts:
        out += [t.stride(0), t.stride(1)]
    return out


def _check(q_u: Tensor, k_u: Tensor, v_u: Tensor, q_c: Tensor) -> None:
    if not (q_u.shape == k_u.shape == v_u.shape) or q_c.shape[1:] != q_u.shape[1:]:
        raise ValueError(
            f"hstu attention: q/k/v of the history must share a shape and candidates its "
            f"[H, d]; got {tuple(q_u.shape)}, {tuple(k_u.shape)}, {tuple(v_u.shape)}, "
            f"{tuple(q_c.shape)}"
        )
    if len({q_u.dtype, k_u.dtype, v_u.dtype, q_c.dtype}) != 1:
        raise ValueError("hstu attention: q, k, v and candidate q must share a dtype")
    for t in (q_u, k_u, v_u, q_c):
        if t.stride(-1) != 1:
            raise ValueError("hstu attention: the head dim must be contiguous (stride 1)")


def _common(q: Tensor, has_bias: bool, interpreted: bool) -> dict:
    head_dim = q.shape[-1]
    prec = "ieee" if torch.get_float32_matmul_precision() == "highest" else "tf32"
    return {
        "D": max(16, triton_module("common").next_pow2(head_dim)),
        "HAS_BIAS": has_bias,
        # tanh.approx (~2^-11) is below bf16's rounding, not float32's.
        "FAST": not interpreted and q.dtype != torch.float32,
        "PREC": prec,
    }


class _Fused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_u, k_u, v_u, q_c, pos, tim, sched, t_u, t_c, uih_out):  # type: ignore[override]
        kern = triton_module("attention.hstu_fwd")
        H, dh = q_u.shape[1], q_u.shape[2]
        alpha = dh**-0.5
        interp = _interpreting(kern._fwd_kernel)
        has_bias = pos is not None
        const = _common(q_u, has_bias, interp)
        out_u = torch.empty(q_u.shape, dtype=q_u.dtype, device=q_u.device) if uih_out else None
        out_c = torch.empty(q_c.shape, dtype=q_c.dtype, device=q_c.device)
        o_u = out_u if out_u is not None else out_c  # a stand-in nothing writes
        bias_args = (pos, tim, *_starts(q_u.device)) if has_bias else (sched.uih_offsets,) * 4
        times = (t_u, t_c) if has_bias else (sched.uih_offsets, sched.uih_offsets)
        rows = "all" if uih_out else "cand"

        def launch(cfg):
            bm, bn, warps, stages = cfg
            start, grid = sched.blocks(rows, bm)
            kern._fwd_kernel[(grid, H)](
                q_u, k_u, v_u, q_c, o_u, out_c, *times, sched.uih_offsets, sched.cand_offsets,
                sched.order, start, *bias_args,
                *_strides(q_u, k_u, v_u, q_c, o_u, out_c), sched.batch, alpha, dh,
                BM=bm, BN=bn, UIH_OUT=uih_out, num_warps=warps, num_stages=stages, **const,
            )  # fmt: skip

        key = (dh, q_u.dtype, has_bias, uih_out, *sched.tune_key())
        launch(_pick("fwd", key, launch, interp))
        ctx.save_for_backward(q_u, k_u, v_u, q_c, pos, tim, t_u, t_c)
        ctx.sched, ctx.uih_out, ctx.key = sched, uih_out, key
        return out_u, out_c

    @staticmethod
    def backward(ctx, do_u, do_c):  # type: ignore[override]
        q_u, k_u, v_u, q_c, pos, tim, t_u, t_c = ctx.saved_tensors
        sched, uih_out, key = ctx.sched, ctx.uih_out, ctx.key
        kern = triton_module("attention.hstu_bwd")
        H, dh = q_u.shape[1], q_u.shape[2]
        alpha = dh**-0.5
        interp = _interpreting(kern._dq_kernel)
        has_bias = pos is not None
        const = _common(q_u, has_bias, interp)
        if do_u is None:
            do_u = do_c  # a stand-in: no history row is read without uih_out
        dq_u = torch.empty_like(q_u, memory_format=torch.contiguous_format) if uih_out else None
        dq_c = torch.empty_like(q_c, memory_format=torch.contiguous_format)
        dk = torch.empty_like(k_u, memory_format=torch.contiguous_format)
        dv = torch.empty_like(v_u, memory_format=torch.contiguous_format)
        dq_u_arg = dq_u if dq_u is not None else dq_c
        bias_args = (pos, tim, *_starts(q_u.device)) if has_bias else (sched.uih_offsets,) * 4
        times = (t_u, t_c) if has_bias else (sched.uih_offsets, sched.uih_offsets)
        rows = "all" if uih_out else "cand"
        parts: dict[str, Tensor] = {}

        def launch_dq(cfg):
            bm, bn, warps, stages = cfg
            start, grid = sched.blocks(rows, bm)
            kern._dq_kernel[(grid, H)](
                q_u, k_u, v_u, q_c, do_u, do_c, dq_u_arg, dq_c, *times, sched.uih_offsets,
                sched.cand_offsets, sched.order, start, *bias_args,
                *_strides(q_u, k_u, v_u, q_c, do_u, do_c, dq_u_arg, dq_c), sched.batch, alpha, dh,
                BM=bm, BN=bn, UIH_OUT=uih_out, num_warps=warps, num_stages=stages, **const,
            )  # fmt: skip

        def launch_dkdv(cfg):
            bm, bn, warps, stages = cfg
            start, grid = sched.blocks("keys", bn)
            nb = (POSITION.count, TIME.count)
            dpos = torch.zeros(grid * H if has_bias else 1, nb[0], device=q_u.device)
            dtim = torch.zeros(grid * H if has_bias else 1, nb[1], device=q_u.device)
            kern._dkdv_kernel[(grid, H)](
                q_u, k_u, v_u, q_c, do_u, do_c, dk, dv, dpos, dtim, *times, sched.uih_offsets,
                sched.cand_offsets, sched.order, start, *bias_args,
                *_strides(q_u, k_u, v_u, q_c, do_u, do_c, dk, dv), sched.batch, alpha, dh, H,
                BM=bm, BN=bn, UIH_OUT=uih_out, num_warps=warps, num_stages=stages, **const,
            )  # fmt: skip
            parts["pos"], parts["time"] = dpos, dtim

        launch_dq(_pick("dq", key, launch_dq, interp))
        launch_dkdv(_pick("dkdv", key, launch_dkdv, interp))
        d_pos = d_tim = None
        if has_bias:
            d_pos = parts["pos"].sum(0).view(pos.shape).to(pos.dtype)
            d_tim = parts["time"].sum(0).view(tim.shape).to(tim.dtype)
        return dq_u, dk, dv, dq_c, d_pos, d_tim, None, None, None, None


def hstu_attention(
    q_u: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    q_c: Tensor,
    sched: Schedule,
    uih_times: Tensor | None = None,
    cand_times: Tensor | None = None,
    pos_table: Tensor | None = None,
    time_table: Tensor | None = None,
    uih_out: bool = True,
) -> tuple[Tensor | None, Tensor]:
    """(history outputs [Tu, H, d] or None without ``uih_out``, candidate outputs
    [Tc, H, d]) of the formula in the module docstring, by the Triton kernels.

    q/k/v: [T, H, d] (any row and head strides, the head dim contiguous), one
    dtype; times int64 [Tu] / [Tc] and both tables (float, ``count`` entries) or
    none of them. Differentiable in q/k/v and the tables."""
    _check(q_u, k_u, v_u, q_c)
    if (pos_table is None) != (time_table is None):
        raise ValueError("hstu attention: give both bias tables or neither")
    if pos_table is not None and (uih_times is None or cand_times is None):
        raise ValueError("hstu attention: the relative bias needs history and candidate times")
    if sched.batch == 0:
        empty = q_c.new_zeros(q_c.shape)
        return (q_u.new_zeros(q_u.shape) if uih_out else None), empty
    return _Fused.apply(
        q_u, k_u, v_u, q_c, pos_table, time_table, sched, uih_times, cand_times, uih_out
    )


@functools.cache
def opaque_hstu_attention() -> Callable[..., tuple[Tensor | None, Tensor]]:
    """`hstu_attention` as compiled code calls it: opaque to dynamo (Triton launches,
    host-side schedules and tuning). Made on first use: `torch.compiler.disable`
    imports dynamo, and with it Triton."""
    return torch.compiler.disable(hstu_attention)


def reference(
    q_u: Tensor,
    k_u: Tensor,
    v_u: Tensor,
    q_c: Tensor,
    uih_offsets: Tensor,
    cand_offsets: Tensor,
    uih_times: Tensor | None = None,
    cand_times: Tensor | None = None,
    pos_table: Tensor | None = None,
    time_table: Tensor | None = None,
    uih_out: bool = True,
) -> tuple[Tensor | None, Tensor]:
    """The same outputs, one sample at a time in float32 (the twin of the kernels)."""
    alpha = q_u.shape[-1] ** -0.5
    f = [t.float() for t in (q_u, k_u, v_u, q_c)]
    hb, cb = uih_offsets.tolist(), cand_offsets.tolist()
    outs_u, outs_c = [f[0][:0]], [f[3][:0]]

    def rab(p: Tensor, dt: Tensor) -> Tensor | float:
        if pos_table is None:
            return 0.0
        pos, tim = pos_table.float().view(-1), time_table.float().view(-1)
        return pos[log_buckets(p, POSITION).long()] + tim[log_buckets(dt, TIME).long()]

    for i in range(len(hb) - 1):
        h0, h1, c0, c1 = hb[i], hb[i + 1], cb[i], cb[i + 1]
        n = h1 - h0
        q, k, v, qc = f[0][h0:h1], f[1][h0:h1], f[2][h0:h1], f[3][c0:c1]
        pos = torch.arange(n, device=q.device)
        t = uih_times[h0:h1] if uih_times is not None else pos
        if uih_out:
            s = torch.einsum("qhd,khd->hqk", q * alpha, k)
            s = s + rab(pos[:, None] - pos[None, :], t[:, None] - t[None, :])
            a = torch.nn.functional.silu(s) * (pos[:, None] >= pos[None, :])
            outs_u.append(torch.einsum("hqk,khd->qhd", a, v) / (n + 1))
        tc = cand_times[c0:c1] if cand_times is not None else pos[:0]
        s = torch.einsum("chd,khd->hck", qc * alpha, k)
        if pos_table is not None:
            s = s + rab((n - pos)[None, :], tc[:, None] - t[None, :])
        outs_c.append(torch.einsum("hck,khd->chd", torch.nn.functional.silu(s), v) / (n + 1))
    return (torch.cat(outs_u) if uih_out else None), torch.cat(outs_c)
