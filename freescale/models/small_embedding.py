"""`SmallEmbedding`: an ``nn.Embedding`` whose CUDA backward suits a table of a few rows."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from freescale.kernels.backend import choose_impl
from freescale.kernels.small_table import MAX_ROWS, small_table_grad


class SmallEmbedding(nn.Embedding):
    """Same parameters, state dict and forward values as ``nn.Embedding``.

    On the Triton path (CUDA) its weight gradient comes from
    `freescale.kernels.small_table`: two kernels and bitwise reproducible,
    where torch's sort-based backward launches ~30 and sums with atomics.
    Elsewhere (the CPU, more than ``MAX_ROWS`` rows, padding_idx, max_norm,
    frequency scaling, sparse gradients, fp64) it is ``nn.Embedding`` itself."""

    def forward(self, ids: Tensor) -> Tensor:
        if self._plain() or choose_impl(None, self.weight.device) != "triton":
            return super().forward(ids)
        return _SmallLookup.apply(self.weight, ids)

    def _plain(self) -> bool:
        return (
            self.num_embeddings > MAX_ROWS
            or self.padding_idx is not None
            or self.max_norm is not None
            or self.scale_grad_by_freq
            or self.sparse
            or self.weight.dtype == torch.float64  # the kernels sum in fp32
        )


class _SmallLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: Tensor, ids: Tensor) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(ids)
        ctx.rows = weight.shape[0]
        # What F.embedding computes: the same copy of rows, so the same values.
        return weight.index_select(0, ids.reshape(-1)).view(*ids.shape, weight.shape[1])

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        return small_table_grad(flat, ids.reshape(-1), ctx.rows), None
