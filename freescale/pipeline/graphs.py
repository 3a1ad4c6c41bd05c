"""CUDA graphs of the dense block stack, one per padded shape ("bucket").

At small batches the host, not the GPU, sets the step time: the blocks'
forward and backward are ~100 + ~300 kernel launches per step whose host
cost exceeds their GPU time (measured at world size 1 on an H200). Replaying a captured
graph issues each pass with one call.

Jagged inputs change length every step, so a graph is captured per bucket of
padded sizes (UIH rows in 1/8-octave steps; candidate rows and the sample
count padded to the largest seen) and the inputs are padded up to it; the
attention maxima are a ceiling (the longest seen) that a graph serves below.
Padding rows lie outside every attention segment: the flash
kernels neither read nor write them, so they cost no attention work (a
*fake sample* would: tried first, a 20k-token one nearly doubled the step at
UIH 21k). What flash leaves unwritten is garbage, and a NaN row times a zero
gradient still poisons a weight gradient, so the attention output of padding
rows is masked to 0 and their q/k/v gradients are zeroed by a select
(`AttentionLayout.q_pad`/`k_pad`). Real rows never see padding, and the head
never reads padded candidates, so their gradient is exactly zero.

The attention in the graphs is varlen's: ``model.attention=cudnn`` is refused
and ``auto`` does not pick cuDNN in a graphed stack (eager steps included).
cuDNN's capture, and the fixed per-bucket offsets, lengths and workspace it
would need, are not tried.

The numbers are close to, not bitwise equal to, the eager path's (padding
changes the GEMM shapes and so their rounding): graphs are opt-in
(``dense.graphs=true``); eager stays the default and the reference.

Applied from outside the model: `GraphedStack` replaces the model's
``block_stack`` (`freescale.models.contract`) with the same blocks run
through these graphs, the candidate path on a side stream (`run_blocks`).

Memory: all buckets share one graph pool and the buffers of their inputs and
input gradients. A bucket's activations are freed at the end of its backward
capture, so the next capture reuses them; this is safe because a step
replays one bucket's forward and backward with no other graph in between,
and every static output is consumed within that step. What stays per
bucket is its candidate output and parameter gradients.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor, nn

from freescale.jagged.ops import side_stream
from freescale.models.blocks import BlockStack, max_lengths
from freescale.pipeline.padded_blocks import (
    Bucket,
    PaddedBlocks,
    bucket,
    padded_offsets,
    write_padded,
)


class _Captured:
    """One bucket's forward and backward graphs.

    Its inputs and the UIH/candidate gradients live in buffers shared by every
    bucket (views of the first rows): one step replays one bucket, so they
    never hold two buckets' data at once, and a bucket costs only its small
    outputs and parameter gradients."""

    def __init__(
        self, body: PaddedBlocks, inputs: tuple[Tensor, ...], sinks: tuple[Tensor, Tensor],
        pool: Any,
    ) -> None:  # fmt: skip
        self.max_uih, self.max_candidates = body.max_uih, body.max_candidates
        self.params = tuple(p for p in body.parameters() if p.requires_grad)
        self.inputs = inputs
        inputs[0].requires_grad_(True)
        inputs[1].requires_grad_(True)
        wrt = (inputs[0], inputs[1], *self.params)
        # One eager pass first, on the capture stream: lazy initialization
        # (cuBLAS workspaces, kernel selection) must not land in the capture.
        # `torch.cuda.graph` would also sync the device, run the garbage
        # collector and empty the allocator's cache: ~0.1 s per capture for
        # nothing here (the step's inputs are ordered by the stream wait).
        stream = _capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = body(*inputs)
            torch.autograd.grad(out, wrt, torch.ones_like(out), allow_unused=True)
            # thread_local: the loader's copy thread keeps allocating on its own stream.
            self.fwd = torch.cuda.CUDAGraph()
            self.fwd.capture_begin(pool=pool, capture_error_mode="thread_local")
            self.out = body(*inputs)
            self.fwd.capture_end()
            self.grad_out = torch.zeros_like(self.out)
            self.bwd = torch.cuda.CUDAGraph()
            self.bwd.capture_begin(pool=pool, capture_error_mode="thread_local")
            grads = torch.autograd.grad(self.out, wrt, self.grad_out, allow_unused=True)
            sinks[0].copy_(grads[0])
            sinks[1].copy_(grads[1])
            self.bwd.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        # An unused parameter gets no gradient (None), as in eager mode.
        self.grads = (*sinks, *grads[2:])
        self.param_grads = [
            (p, g) for p, g in zip(self.params, grads[2:], strict=True) if g is not None
        ]


def _capture_stream() -> torch.cuda.Stream:
    """One stream per device for every capture (and its warm-up pass)."""
    return side_stream("graph capture")


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, cap: _Captured, owner: BlockGraphs | None, uih: Tensor, cand: Tensor,
                uih_offsets: Tensor, cand_offsets: Tensor, *params: Tensor) -> Tensor:  # type: ignore[override]  # fmt: skip
        for static, x in ((cap.inputs[0], uih), (cap.inputs[1], cand)):
            static[: x.shape[0]].copy_(x)
            # Padding rows must be finite (they meet zero gradients in the weight
            # GEMMs): zeros, not what an earlier step left in the shared buffer.
            static[x.shape[0] :].zero_()
        write_padded(cap.inputs[2], uih_offsets, uih.shape[0])
        write_padded(cap.inputs[3], cand_offsets, cand.shape[0])
        cap.fwd.replay()
        ctx.cap, ctx.owner, ctx.rows = cap, owner, (uih.shape[0], cand.shape[0])
        return cap.out[: cand.shape[0]].detach()  # valid until the next replay

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        cap, owner = ctx.cap, ctx.owner
        if owner is not None:
            owner.reclaim_grads()
        cap.grad_out[: grad.shape[0]].copy_(grad)
        cap.grad_out[grad.shape[0] :].zero_()
        cap.bwd.replay()
        g = cap.grads
        n_u, n_c = ctx.rows
        if owner is not None:
            owner.lend_grads(cap)
            return (None, None, g[0][:n_u], g[1][:n_c], None, None)
        # The static gradients themselves (not detached views): autograd then
        # copies them into ``.grad`` instead of adopting the graph's memory,
        # which the next replay overwrites.
        return (None, None, g[0][:n_u], g[1][:n_c], None, None, *g[2:])


class BlockGraphs:
    """``run(...)``: the block stack's candidate output through a captured graph."""

    def __init__(
        self, blocks: nn.ModuleList, max_graphs: int = 32, two_streams: bool = True,
        own_grads: bool = False,
    ) -> None:  # fmt: skip
        self.blocks = blocks
        self.two_streams = two_streams  # `PaddedBlocks.two_streams` of every capture
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[Bucket, _Captured] = OrderedDict()
        self.pool: Any = None
        self.buffers: dict[str, Tensor] = {}
        # Attention maxima of the graphs captured from now on: the longest seen,
        # so a new bucket's graph serves every later step of its sizes.
        self.max_uih = self.max_candidates = 0
        self.candidate_rows = self.segments = 0  # floors of the padded sizes (largest seen)
        self.captures = 0  # graphs captured (a new bucket, longer segments, or an evicted one)
        # The replay sets the parameters' ``.grad`` itself (lent graph memory)
        # instead of handing them to autograd: no AccumulateGrad per parameter.
        # Only where no autograd hook waits on those gradients (the gradient sum's do).
        self.own_grads = own_grads
        self.lent: list[tuple[Tensor, Tensor]] = []  # (parameter, graph memory) of the last replay

    def run(
        self, uih: Tensor, cand: Tensor, uih_offsets: Tensor, cand_offsets: Tensor,
        max_uih: int, max_candidates: int,
    ) -> Tensor:  # fmt: skip
        n_u, n_c = uih.shape[0], cand.shape[0]
        amp = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        samples = uih_offsets.numel() - 1
        b = Bucket.of(n_u, n_c, samples, uih.dtype, amp, self.candidate_rows, self.segments)
        self.candidate_rows, self.segments = b.candidates, b.segments
        self.max_uih = max(self.max_uih, bucket(max_uih))
        self.max_candidates = max(self.max_candidates, bucket(max_candidates))
        self.reclaim_grads()
        cap = self.graphs.get(b)
        if cap is None or cap.max_uih < max_uih or cap.max_candidates < max_candidates:
            cu_u, cu_c = padded_offsets(uih_offsets, cand_offsets, n_u, n_c, b)
            cap = self._capture(b, uih, cand, cu_u, cu_c)
        self.graphs.move_to_end(b)
        if self.own_grads and (uih.requires_grad or cand.requires_grad):
            return _Replay.apply(cap, self, uih, cand, uih_offsets, cand_offsets)
        return _Replay.apply(cap, None, uih, cand, uih_offsets, cand_offsets, *cap.params)

    def lend_grads(self, cap: _Captured) -> None:
        """Each parameter's ``.grad`` becomes (or, if it has one, adds) its graph
        gradient: what AccumulateGrad would store, without its copy per parameter."""
        for p, g in cap.param_grads:
            if p.grad is None:
                p.grad = g  # graph memory: any replay may rewrite it (the pool is shared)
            else:
                p.grad.add_(g)
        self.lent = cap.param_grads

    def reclaim_grads(self) -> None:
        """Before any replay: a ``.grad`` still lent (an optimizer step not taken
        yet, gradients accumulated over backwards) gets memory of its own."""
        for p, g in self.lent:
            if p.grad is not None and p.grad.data_ptr() == g.data_ptr():
                p.grad = g.clone()
        self.lent = []

    def _shared(self, name: str, rows: int, like: Tensor) -> Tensor:
        """The first ``rows`` rows of a buffer shared by all buckets (grown as needed;
        graphs captured on a smaller one keep it alive)."""
        buf = self.buffers.get(name)
        if buf is None or buf.shape[0] < rows or buf.dtype != like.dtype:
            # Headroom of two buckets: early steps' sizes creep up, and every
            # outgrown buffer stays alive with the graphs captured on it.
            size = bucket(rows + rows // 4)
            buf = self.buffers[name] = like.new_zeros((size, *like.shape[1:]))
        return buf[:rows]

    def _capture(
        self, b: Bucket, uih: Tensor, cand: Tensor, cu_u: Tensor, cu_c: Tensor
    ) -> _Captured:
        body = PaddedBlocks(
            self.blocks, self.max_uih, self.max_candidates, two_streams=self.two_streams
        )
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        inputs = (
            self._shared("uih", b.tokens, uih),
            self._shared("cand", b.candidates, cand),
            cu_u.clone(),
            cu_c.clone(),
        )
        sinks = (
            self._shared("grad_uih", b.tokens, uih),
            self._shared("grad_cand", b.candidates, cand),
        )
        amp = torch.autocast(
            "cuda", dtype=b.amp or torch.bfloat16, enabled=b.amp is not None, cache_enabled=False
        )
        with amp:
            cap = _Captured(body, inputs, sinks, self.pool)
        self.graphs[b] = cap
        self.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return cap


def check_attention(attention: str, cross_attention: str = "auto") -> None:
    """The graphs run the varlen attention: ValueError (one line) for another.

    ``cudnn`` is refused rather than captured: its graphs' capture and the
    padding rows' handling inside them are untested, and ``auto`` runs
    varlen in a graphed stack (`GraphedStack.cudnn_self_attention`); so does
    the cross-attention (`GraphedStack.triton_cross_attention`: the Triton
    kernel's capture is not tried)."""
    if attention in ("reference", "cudnn"):
        raise ValueError(
            f"dense.graphs=true needs model.attention=auto or varlen (CUDA graphs run "
            f"varlen), got {attention}"
        )
    if cross_attention in ("reference", "triton"):
        raise ValueError(
            f"dense.graphs=true needs model.cross_attention=auto or varlen (CUDA graphs run "
            f"varlen), got {cross_attention}"
        )


class GraphedStack(BlockStack):
    """A model's `BlockStack` whose training steps on CUDA replay captured graphs.

    Same blocks (so the same parameters and state dict keys); evaluation (no
    gradients), CPU runs and steps without UIH tokens or candidates run the
    stack eagerly. ``own_grads``: see `BlockGraphs` (one rank, no gradient sum hooks).

    Its self- and cross-attention are varlen's, in the graphs and in the eager
    steps alike (``auto`` picks neither cuDNN nor the Triton cross-attention
    here): one kernel for every step."""

    cudnn_self_attention = False
    triton_cross_attention = False

    def __init__(self, stack: BlockStack, two_streams: bool = True, own_grads: bool = False):
        check_attention(stack.attention, stack.cross_attention)
        super().__init__(list(stack), stack.attention, stack.cross_attention)
        self.runner = BlockGraphs(self, two_streams=two_streams, own_grads=own_grads)

    def forward(  # type: ignore[override]
        self,
        uih: Tensor,
        cand: Tensor,
        batch: Any,
        max_uih: int | None = None,
        max_candidates: int | None = None,
    ) -> Tensor:
        graphed = uih.is_cuda and torch.is_grad_enabled() and uih.shape[0] and cand.shape[0]
        if not graphed:
            return super().forward(uih, cand, batch, max_uih, max_candidates)
        uih_off, cand_off = batch.uih.offsets, batch.candidates.offsets
        if max_uih is None or max_candidates is None:
            max_uih, max_candidates = max_lengths(uih_off, cand_off)
        return self.runner.run(uih, cand, uih_off, cand_off, max_uih, max_candidates)


def install_graphs(model: nn.Module, two_streams: bool, own_grads: bool) -> BlockGraphs:
    """Replace ``model``'s block stack (`RecModel.block_stack`) by a `GraphedStack`;
    its `BlockGraphs` (for the capture count). One-line ValueError if the model
    has no such stack."""
    path = getattr(model, "block_stack", None)
    stack = model.get_submodule(path) if isinstance(path, str) and path else None
    if not isinstance(stack, BlockStack):
        raise ValueError(
            "dense.graphs=true needs a model with a block_stack (a BlockStack of "
            "freescale.models.blocks); this model has none"
        )
    graphed = GraphedStack(stack, two_streams=two_streams, own_grads=own_grads)
    model.set_submodule(path, graphed)
    return graphed.runner
