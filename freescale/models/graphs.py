"""CUDA graphs of the dense block stack, one per padded shape ("bucket").

At small batches the host, not the GPU, sets the step time: the blocks'
forward and backward are ~100 + ~300 kernel launches per step whose host
cost exceeds their GPU time (docs/LOG.md, issue 18). Replaying a captured
graph issues each pass with one call.

Jagged inputs change length every step, so a graph is captured per bucket of
padded sizes (8 sizes per octave: at most 1/8 padding; maxima likewise; the
sample count rounded up to 8 with empty samples) and the inputs are padded
up to it. Padding rows lie outside every attention segment: the flash
kernels neither read nor write them, so they cost no attention work (a
*fake sample* would: tried first, a 20k-token one nearly doubled the step at
UIH 21k). What flash leaves unwritten is garbage, and a NaN row times a zero
gradient still poisons a weight gradient, so the attention output of padding
rows is masked to 0 and their q/k/v gradients are zeroed by a select
(`AttentionLayout.q_pad`/`k_pad`). Real rows never see padding, and the head
never reads padded candidates, so their gradient is exactly zero.

The numbers are close to, not bitwise equal to, the eager path's (padding
changes the GEMM shapes and so their rounding): graphs are opt-in
(``dense_graphs=true``); eager stays the default and the reference.

Memory: all buckets share one graph pool. A bucket's activations are freed
at the end of its backward capture, so the next bucket's capture reuses
them; this is safe because a step replays one bucket's forward and backward
with no other bucket's graph in between. What stays per bucket is its
static inputs, outputs and gradients.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from freescale.models.attention import AttentionLayout, Segments

SIZES_PER_OCTAVE = 8


def bucket(n: int) -> int:
    """Smallest ``m * 2**e >= n`` with ``8 <= m <= 16``: at most 1/8 padding
    (``n`` itself below 16)."""
    if n <= 2 * SIZES_PER_OCTAVE:
        return max(n, 1)
    shift = n.bit_length() - SIZES_PER_OCTAVE.bit_length()
    return -(-n // (1 << shift)) << shift


@dataclass(frozen=True)
class Bucket:
    """One padded shape: what a graph is captured for."""

    tokens: int  # UIH rows (real + padding)
    candidates: int
    segments: int  # samples rounded up to 8 (the rest empty)
    max_uih: int  # longest segment the kernels must cover (bucketed)
    max_candidates: int
    dtype: torch.dtype
    amp: torch.dtype | None  # autocast dtype at capture (None: autocast off)

    @staticmethod
    def of(
        n_u: int, n_c: int, samples: int, max_uih: int, max_cand: int, dtype: torch.dtype,
        amp: torch.dtype | None,
    ) -> Bucket:  # fmt: skip
        segments = -(-max(samples, 1) // 8) * 8
        return Bucket(
            bucket(n_u), bucket(n_c), segments, bucket(max_uih), bucket(max_cand), dtype, amp
        )


def padded_offsets(
    uih_offsets: Tensor, cand_offsets: Tensor, n_u: int, n_c: int, b: Bucket
) -> tuple[Tensor, Tensor]:
    """int32 boundaries [segments + 1]: the samples, then empty ones. Padding
    rows (``n_u..tokens``) lie in no segment. Built on the device: no read-back."""
    empty = b.segments - (uih_offsets.numel() - 1)
    cu_u = torch.cat(
        [uih_offsets.to(torch.int32), uih_offsets.new_full((empty,), n_u, dtype=torch.int32)]
    )
    cu_c = torch.cat(
        [cand_offsets.to(torch.int32), cand_offsets.new_full((empty,), n_c, dtype=torch.int32)]
    )
    return cu_u, cu_c


def _segment_masks(cu_u: Tensor, cu_c: Tensor, tokens: int, cands: int) -> tuple[Tensor, ...]:
    """[rows, 1, 1] bool masks, on the device: UIH padding, candidate padding,
    and candidates without keys (an empty UIH, or padding)."""
    rows_u = torch.arange(tokens, device=cu_u.device, dtype=torch.int32)
    rows_c = torch.arange(cands, device=cu_c.device, dtype=torch.int32)
    pad_u, pad_c = rows_u >= cu_u[-1], rows_c >= cu_c[-1]
    # Padding candidates fall after the last boundary: segment index = #segments,
    # whose key count is the appended 0.
    k_len = torch.cat([cu_u[1:] - cu_u[:-1], cu_u.new_zeros(1)])
    owner = torch.searchsorted(cu_c, rows_c, right=True) - 1
    no_keys = k_len[owner] == 0
    return pad_u[:, None, None], pad_c[:, None, None], no_keys[:, None, None]


class PaddedBlocks(nn.Module):
    """The block stack over padded inputs: the body a graph captures.

    Runs eagerly too (on the CPU with the reference attention), which is how
    the padding is tested against the unpadded stack."""

    def __init__(
        self, blocks: nn.ModuleList, max_uih: int, max_candidates: int, impl: str | None = None
    ) -> None:
        super().__init__()
        self.blocks = blocks
        self.max_uih, self.max_candidates = max_uih, max_candidates
        self.impl = impl  # None: varlen on CUDA, reference elsewhere

    def forward(self, uih: Tensor, cand: Tensor, cu_u: Tensor, cu_c: Tensor) -> Tensor:
        """The candidates' output [candidates, dim] (the UIH output has no reader)."""
        impl = self.impl or ("varlen" if uih.is_cuda else "reference")
        bounds_u = cu_u.tolist() if impl == "reference" else None
        bounds_c = cu_c.tolist() if impl == "reference" else None
        su = Segments(cu_u, cu=cu_u, max_len=self.max_uih, bounds=bounds_u)
        sc = Segments(cu_c, cu=cu_c, max_len=self.max_candidates, bounds=bounds_c)
        pad_u, pad_c, no_keys = _segment_masks(cu_u, cu_c, uih.shape[0], cand.shape[0])
        layout = (
            AttentionLayout(impl, su, su, True, pad_u, q_pad=pad_u, k_pad=pad_u),
            AttentionLayout(impl, sc, su, False, no_keys, q_pad=pad_c, k_pad=pad_u),
        )
        for block in self.blocks:
            uih, cand = block(uih, cand, layout)
        return cand


def pad_rows(x: Tensor, rows: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0]))


def padded_inputs(
    uih: Tensor, cand: Tensor, uih_offsets: Tensor, cand_offsets: Tensor,
    max_uih: int, max_candidates: int, amp: torch.dtype | None = None,
) -> tuple[Bucket, tuple[Tensor, Tensor, Tensor, Tensor]]:  # fmt: skip
    """The bucket of a step and its padded `PaddedBlocks` arguments."""
    n_u, n_c = uih.shape[0], cand.shape[0]
    b = Bucket.of(n_u, n_c, uih_offsets.numel() - 1, max_uih, max_candidates, uih.dtype, amp)
    cu_u, cu_c = padded_offsets(uih_offsets, cand_offsets, n_u, n_c, b)
    return b, (pad_rows(uih, b.tokens), pad_rows(cand, b.candidates), cu_u, cu_c)


class _Captured:
    """One bucket's forward and backward graphs and their static tensors."""

    def __init__(self, body: PaddedBlocks, args: tuple[Tensor, ...], pool: Any) -> None:
        self.params = tuple(p for p in body.parameters() if p.requires_grad)
        self.inputs = tuple(a.detach().clone() for a in args)
        self.inputs[0].requires_grad_(True)
        self.inputs[1].requires_grad_(True)
        wrt = (self.inputs[0], self.inputs[1], *self.params)
        # Warm-up on a side stream: lazy initialization (cuBLAS workspaces,
        # kernel selection) must not land in the capture.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                out = body(*self.inputs)
                torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
        torch.cuda.current_stream().wait_stream(side)
        # thread_local: the loader's copy thread keeps allocating on its own stream.
        self.fwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.fwd, pool=pool, capture_error_mode="thread_local"):
            self.out = body(*self.inputs)
        self.grad_out = torch.empty_like(self.out)
        self.bwd = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.bwd, pool=pool, capture_error_mode="thread_local"):
            grads = torch.autograd.grad(self.out, wrt, self.grad_out, allow_unused=True)
        # An unused parameter gets no gradient in eager mode either.
        self.grads = tuple(grads)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, cap: _Captured, *args: Tensor) -> Tensor:  # type: ignore[override]
        for static, x in zip(cap.inputs, args[:4], strict=True):
            static.copy_(x)
        cap.fwd.replay()
        ctx.cap = cap
        return cap.out.detach()  # valid until this bucket (or another) replays again

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        cap = ctx.cap
        cap.grad_out.copy_(grad)
        cap.bwd.replay()
        # The static gradients themselves (not detached views): autograd then
        # copies them into ``.grad`` instead of adopting the graph's memory,
        # which the next replay overwrites.
        g = cap.grads
        return (None, g[0], g[1], None, None, *g[2:])


class BlockGraphs:
    """``run(...)``: the block stack's candidate output through a captured graph."""

    def __init__(self, blocks: nn.ModuleList, max_graphs: int = 16) -> None:
        self.blocks = blocks
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[Bucket, _Captured] = OrderedDict()
        self.pool: Any = None
        self.captures = 0  # how many graphs were captured (a new bucket, or an evicted one)

    def run(
        self, uih: Tensor, cand: Tensor, uih_offsets: Tensor, cand_offsets: Tensor,
        max_uih: int, max_candidates: int,
    ) -> Tensor:  # fmt: skip
        amp = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        b, args = padded_inputs(uih, cand, uih_offsets, cand_offsets, max_uih, max_candidates, amp)
        cap = self.graphs.get(b)
        if cap is None:
            cap = self._capture(b, args)
        self.graphs.move_to_end(b)
        out = _Replay.apply(cap, *args, *cap.params)
        return out[: cand.shape[0]]

    def _capture(self, b: Bucket, args: tuple[Tensor, ...]) -> _Captured:
        body = PaddedBlocks(self.blocks, b.max_uih, b.max_candidates)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        amp = torch.autocast(
            "cuda", dtype=b.amp or torch.bfloat16, enabled=b.amp is not None, cache_enabled=False
        )
        with amp:
            cap = _Captured(body, args, self.pool)
        self.graphs[b] = cap
        self.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return cap
