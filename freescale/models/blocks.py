"""The reference sequence model's transformer blocks: `Block` (pre-norm, shared
by UIH and candidate rows) and `BlockStack` (the blocks and the attention
layouts they share), the model's capturable region (`RecModel.block_stack`,
replaced by `freescale.pipeline.graphs` under ``dense.graphs``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from freescale.jagged.batch import UIH_IDS, SampleBatch
from freescale.kernels.attention import cudnn_sdpa
from freescale.kernels.linear import Linear
from freescale.models.attention import (
    AttentionLayout,
    Segments,
    attend,
    attention_layout,
    cross_attention_impl,
    segments,
    self_attention_impl,
)
from freescale.models.attention_op import exported_kind
from freescale.models.dropout import RowDropout
from freescale.models.padded_attention import padded
from freescale.models.sequence_config import ModelConfig


class Block(nn.Module):
    """Pre-norm block shared by UIH and candidate tokens (same weights)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d, self.heads, self.impl, self.layer = cfg.dim, cfg.heads, cfg.attention, layer
        self.head_dim = d // cfg.heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # `Linear`: no memset per bias gradient where that matters (`kernels.linear`).
        self.qkv, self.proj = Linear(d, 3 * d), Linear(d, d)
        self.mlp = nn.Sequential(
            Linear(d, cfg.mlp_ratio * d), nn.GELU(), Linear(cfg.mlp_ratio * d, d)
        )
        self.attend = attend  # `compile` swaps in its opaque twin

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """`nn.Module.compile`, with the attention left out of the compiled code:
        it runs as it does eagerly (cuDNN's graphs, varlen, the reference's
        per-sample loop, none of which dynamo should trace or specialize on),
        one graph break per call; the norms, projections, head splits, casts,
        residuals and MLP around it are compiled (`freescale.pipeline.compile`)."""
        self.attend = torch.compiler.disable(attend)
        super().compile(*args, **kwargs)

    def _heads(self, x: Tensor) -> Tensor:
        return x.view(x.shape[0], self.heads, x.shape[-1] // self.heads)  # 0 rows work too

    # The block as two paths that meet only at the UIH keys and values: a caller
    # may run the candidate path elsewhere (`BlockStack`'s docstring).
    def cand_query(self, cand: Tensor) -> Tensor:
        """The candidates' attention queries."""
        return self._heads(self.qkv(self.norm1(cand)).chunk(3, dim=-1)[0])

    def uih_qkv(self, uih: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The UIH queries, keys and values (the keys and values: one storage)."""
        q, k, v = (self._heads(t) for t in self.qkv(self.norm1(uih)).chunk(3, dim=-1))
        return q, k, v

    def cand_update(
        self,
        cand: Tensor,
        qc: Tensor,
        ku: Tensor,
        vu: Tensor,
        layout: AttentionLayout,
        drop: RowDropout | None = None,
    ) -> Tensor:
        """The candidates after this block (cross-attention to the UIH, MLP)."""
        return self._residuals(cand, self.attend(qc, ku, vu, layout), "cand", drop)

    def uih_update(
        self,
        uih: Tensor,
        qu: Tensor,
        ku: Tensor,
        vu: Tensor,
        layout: AttentionLayout,
        drop: RowDropout | None = None,
    ) -> Tensor:
        """The UIH after this block (causal self-attention, MLP)."""
        return self._residuals(uih, self.attend(qu, ku, vu, layout), "uih", drop)

    def _residuals(self, x: Tensor, att: Tensor, rows: str, drop: RowDropout | None) -> Tensor:
        att = self.proj(att.flatten(1))
        x = x + (att if drop is None else drop(att, rows, "attn", self.layer))
        mlp = self.mlp(self.norm2(x))
        return x + (mlp if drop is None else drop(mlp, rows, "ffn", self.layer))

    def forward(
        self,
        uih: Tensor,
        cand: Tensor,
        layout: tuple[AttentionLayout, AttentionLayout],
        uih_out: bool = True,
        drop: RowDropout | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``layout``: (UIH self-attention, candidate cross-attention), from
        `BlockStack.layouts`.

        ``uih_out=False`` (the last block): the UIH update has no reader, so it
        is skipped and ``uih`` comes back unchanged; the candidates' numbers
        are the same. ``drop``: this step's dropout (None: none)."""
        qc = self.cand_query(cand)
        qu, ku, vu = self.uih_qkv(uih)
        cand = self.cand_update(cand, qc, ku, vu, layout[1], drop)
        if uih_out:
            uih = self.uih_update(uih, qu, ku, vu, layout[0], drop)
        return uih, cand


class BlockStack(nn.ModuleList):
    """The blocks, run on a step's UIH and candidate rows: the model's
    *capturable* region (`RecModel.block_stack`).

    ``forward(uih, cand, batch, max_uih, max_candidates)`` -> the candidates'
    output; nothing else of the step enters it, and its inputs are the two row
    tensors and the batch's offsets. A pipeline may therefore replace this
    module (same blocks, same parameters, same state dict) with one that runs
    the same blocks another way: `Block`'s two paths (`cand_query` →
    `cand_update`, `uih_qkv` → `uih_update`) only meet at the UIH keys and
    values, so the candidate path may run concurrently with the UIH path."""

    # ``auto`` may pick cuDNN for the causal self-attention and the Triton
    # kernel for the cross-attention (a stack replaying CUDA graphs says no:
    # its graphs run varlen, and so do its eager steps).
    cudnn_self_attention = True
    triton_cross_attention = True
    # Both patterns padded (an exported program's fallback; tests set it eagerly).
    padded = False

    def __init__(self, blocks: list[Block], attention: str, cross_attention: str = "auto") -> None:
        super().__init__(blocks)
        self.attention = attention  # auto | reference | varlen | cudnn
        self.cross_attention = cross_attention  # auto | reference | varlen | triton

    def forward(  # type: ignore[override]
        self,
        uih: Tensor,
        cand: Tensor,
        batch: SampleBatch,
        max_uih: int | None = None,
        max_candidates: int | None = None,
        drop: RowDropout | None = None,
    ) -> Tensor:
        layout = self.layouts(batch, uih.is_cuda, max_uih, max_candidates)
        last = len(self) - 1
        for i, block in enumerate(self):
            uih, cand = block(uih, cand, layout, uih_out=i < last, drop=drop)
        return cand

    def layouts(
        self,
        batch: SampleBatch,
        on_cuda: bool,
        max_uih: int | None = None,
        max_candidates: int | None = None,
    ) -> tuple[AttentionLayout, AttentionLayout]:
        """(UIH self-attention, candidate cross-attention) layouts, once per forward:
        every layer shares them. Maxima not given are read back in one host read.

        Under `torch.export` both patterns call one op each (`attention_op`),
        or run padded (`padded_attention`) inside `exported_attention("padded")`:
        each is a single program for every batch shape."""
        uih_off, cand_off = batch.uih.offsets, batch.candidates.offsets
        exporting = torch.compiler.is_exporting()
        if self.padded or (exporting and exported_kind() == "padded"):
            return padded_layouts(batch, max_uih, max_candidates)
        if exporting:
            uih, cand = Segments(uih_off), Segments(cand_off)
            options = (self.attention, self.cross_attention)
            return (
                AttentionLayout("op", uih, uih, True, options=options),
                AttentionLayout("op", cand, uih, False, options=options),
            )
        device = (uih_off.device if uih_off.is_cuda else torch.device("cuda")) if on_cuda else None
        own = self.self_attention_impl(device)
        impl = self.cross_attention_impl(on_cuda)
        if impl == "varlen" and (max_uih is None or max_candidates is None):
            max_uih, max_candidates = max_lengths(uih_off, cand_off)
        uih = segments(uih_off, own, max_uih, fallback=self.attention == "auto")
        cand = segments(cand_off, impl, max_candidates)
        keys = _keys_for(impl, uih, max_uih)
        return (
            attention_layout(uih, uih, True, batch.uih[UIH_IDS].numel()),
            attention_layout(cand, keys, False, batch.num_candidates_total, impl=impl),
        )

    def cross_attention_impl(self, on_cuda: bool) -> str:
        """The cross-attention's implementation (`attention.cross_attention_impl`)."""
        head_dim = self[0].head_dim if len(self) else 0
        return cross_attention_impl(
            self.cross_attention, self.attention, on_cuda, head_dim, self.triton_cross_attention
        )

    def self_attention_impl(self, device: torch.device | None) -> str:
        """The causal self-attention's implementation on ``device`` (None: the
        CPU): `attention.self_attention_impl` of this stack's option; a one-line
        ValueError for ``cudnn`` where it cannot run."""
        head_dim = self[0].head_dim if len(self) else 0
        return self_attention_impl(self.attention, device, head_dim, self.cudnn_self_attention)


def padded_layouts(
    batch: SampleBatch, max_uih: int | None, max_candidates: int | None
) -> tuple[AttentionLayout, AttentionLayout]:
    """Both patterns over the padded batch; widths not given: one host read."""
    uih_off, cand_off = batch.uih.offsets, batch.candidates.offsets
    if max_uih is None or max_candidates is None:
        max_uih, max_candidates = max_lengths(uih_off, cand_off)
    n_u, n_c = batch.uih[UIH_IDS].shape[0], batch.num_candidates_total
    uih = Segments(uih_off, padded=padded(uih_off, n_u, max_uih))
    cand = Segments(cand_off, padded=padded(cand_off, n_c, max_candidates))
    return (
        AttentionLayout("padded", uih, uih, True),
        AttentionLayout("padded", cand, uih, False),
    )


def _keys_for(impl: str, uih: Segments, max_uih: int | None) -> Segments:
    """The UIH segments as the cross-attention ``impl`` reads them: the
    self-attention's, prepared again only where they lack what it needs (an
    explicit ``cross_attention`` that differs from the attention's path)."""
    if impl == "reference" and uih.bounds is None:
        return segments(uih.offsets, "reference")
    if impl == "varlen" and uih.cu is None:
        return segments(uih.offsets, "varlen", max_uih)
    return uih


def check_attention_device(model: nn.Module, device: torch.device) -> None:
    """A one-line ValueError, at the start of a run, when a block stack of
    ``model`` asks for an attention ``device`` cannot run (``cudnn`` without
    the package or an sm90+ GPU); its first forward would raise it otherwise."""
    for module in model.modules():
        if isinstance(module, BlockStack):
            module.self_attention_impl(device if device.type == "cuda" else None)


def attention_in_use(model: nn.Module, device: torch.device) -> dict[str, str] | None:
    """The attention a block stack of ``model`` runs on ``device`` (the run
    summary's ``attention``): ``self`` and ``cross`` implementations, and
    ``self_why`` where ``auto`` could not take cuDNN on a GPU (a missing
    package is otherwise silent: varlen runs instead). None without a stack."""
    for module in model.modules():
        if isinstance(module, BlockStack):
            cuda = device.type == "cuda"
            own = module.self_attention_impl(device if cuda else None)
            out = {"self": own, "cross": module.cross_attention_impl(cuda)}
            if cuda and module.attention == "auto" and own != "cudnn":
                head_dim = module[0].head_dim if len(module) else 0
                why = cudnn_sdpa.unavailable(device, head_dim)
                out["self_why"] = f"not cudnn: needs {why}" if why else "not cudnn: graphed stack"
            return out
    return None


def max_lengths(*offsets: Tensor) -> list[int]:
    """Longest segment of each layout (0 when it has none), in one host read."""
    if offsets[0].numel() < 2:
        return [0] * len(offsets)
    return torch.stack([(o[1:] - o[:-1]).max() for o in offsets]).tolist()
