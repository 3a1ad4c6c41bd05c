"""`Linear`: an ``nn.Linear`` whose bias gradient needs no memset inside CUDA graphs."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from freescale.kernels.backend import choose_impl
from freescale.kernels.small_table import column_sums

_IN_GRAPHS = contextvars.ContextVar("freescale_linear_in_graphs", default=False)


@contextlib.contextmanager
def graph_body() -> Iterator[None]:
    """`Linear`s called inside take the memset-free bias gradient (what a CUDA
    graph captures: `freescale.pipeline.graphs.PaddedBlocks`)."""
    token = _IN_GRAPHS.set(True)
    try:
        yield
    finally:
        _IN_GRAPHS.reset(token)


class Linear(nn.Linear):
    """Same parameters, state dict and forward values as ``nn.Linear``.

    Inside `graph_body` on the Triton path (CUDA), the bias gradient is
    `column_sums` (two Triton kernels) instead of torch's column reduction,
    which zeroes its semaphores with a memset: in the dense blocks' CUDA
    graphs each such memset node left the GPU idle ~3 µs before the next
    kernel, ~29 times a step (UIH 2k, batch 32: 0.6 % of the step). The input
    and weight gradients are the same two matrix products as autograd's, to
    rounding; no double backward. Elsewhere (eager steps, where a memset costs
    no more than a kernel and the custom function's host time would; compiled
    regions, `dense.compile`, which never run inside these graphs and where
    reading the context variable would break the graph) it is ``nn.Linear``."""

    def forward(self, x: Tensor) -> Tensor:
        if (
            self.bias is None
            or torch.compiler.is_compiling()  # a compiled region: plain `nn.Linear`, no break
            or not _IN_GRAPHS.get()
            or x.dtype == torch.float64  # autocast leaves it alone; so does nn.Linear
            or choose_impl(None, x.device) != "triton"
        ):
            return super().forward(x)
        return _Linear.apply(x, self.weight, self.bias)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor) -> Tensor:  # type: ignore[override]
        # Autocast stays on in here: the casts are autocast's own (what F.linear
        # gets under it), made explicit so backward can use the cast operands.
        kind = x.device.type
        amp = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        xc, wc, bc = (t if amp is None else t.to(amp) for t in (x, weight, bias))
        need_x, need_w = ctx.needs_input_grad[:2]
        ctx.save_for_backward(xc if need_w else None, wc if need_x else None)
        ctx.in_features, ctx.compute_dtype = x.shape[-1], wc.dtype
        ctx.dtypes = (x.dtype, weight.dtype, bias.dtype)
        return F.linear(xc, wc, bc)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        xc, wc = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        in_features = ctx.in_features
        g = grad.reshape(-1, grad.shape[-1]).to(ctx.compute_dtype)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = g.mm(wc).view(*grad.shape[:-1], in_features).to(x_dtype)
        if ctx.needs_input_grad[1]:
            gw = g.t().mm(xc.reshape(-1, in_features)).to(w_dtype)
        if ctx.needs_input_grad[2]:
            gb = column_sums(g.contiguous()).to(b_dtype)
        return gx, gw, gb
