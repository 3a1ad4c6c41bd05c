"""The reference sequence recommendation model (single-device code).

tokens: UIH item + action embeddings; candidates: item embedding + mean of
their content embeddings (+ a projection of dense features) → a stack of
pre-norm blocks (UIH causal self-attention; candidate → UIH cross-attention;
MLPs) → one logit per candidate.

Distribution is applied from outside: the item table is a plain
``nn.Embedding`` looked up with one 1-D id tensor per step, so
`freescale.embedding.swap` can replace it with a sharded module.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from freescale.jagged.batch import CAND_IDS, CONTENT_IDS, UIH_ACTIONS, UIH_IDS, SampleBatch
from freescale.jagged.ops import segment_ids
from freescale.jagged.schema import DataSchema
from freescale.kernels.attention.cross import HEAD_DIMS
from freescale.kernels.linear import Linear
from freescale.models.attention import (
    CROSS_IMPLS,
    IMPLS,
    AttentionLayout,
    Segments,
    attend,
    attention_layout,
    cross_attention_impl,
    segments,
    self_attention_impl,
)
from freescale.models.contract import RecModel
from freescale.models.dropout import RowDropout, SampleDropout, check_rate
from freescale.models.padded_attention import padded
from freescale.models.pooling import mean_content
from freescale.models.small_embedding import SmallEmbedding


@dataclass(frozen=True)
class ModelConfig:
    num_items: int = 10_000
    num_actions: int = 4
    dim: int = 64
    heads: int = 2
    layers: int = 2
    mlp_ratio: int = 2
    dense_dim: int = 0
    # auto | reference | varlen | cudnn (`freescale.models.attention`): auto is
    # reference on the CPU; on CUDA cudnn for the causal self-attention where it
    # runs (sm90+, nvidia-cudnn-frontend installed), else varlen
    attention: str = "auto"
    # auto | reference | varlen | triton: the candidate -> UIH cross-attention
    # (`attention.cross_attention_impl`): auto is triton on CUDA unless
    # attention is reference or varlen, which it then follows
    cross_attention: str = "auto"
    # dropout (`freescale.models.dropout`, training steps only): on the history's
    # embeddings, on each block's attention output and MLP output
    emb_dropout: float = 0.0
    attn_dropout: float = 0.0
    ffn_dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("emb_dropout", "attn_dropout", "ffn_dropout"):
            check_rate(name, getattr(self, name))
        for name in ("num_items", "num_actions", "dim", "heads", "layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"model dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.dense_dim < 0:
            raise ValueError("model dense_dim must be >= 0")
        if self.attention not in IMPLS:
            raise ValueError(
                f"model attention must be one of {', '.join(IMPLS)}; got {self.attention!r}"
            )
        if self.cross_attention not in CROSS_IMPLS:
            raise ValueError(
                f"model cross_attention must be one of {', '.join(CROSS_IMPLS)}; "
                f"got {self.cross_attention!r}"
            )
        if self.cross_attention == "triton" and self.dim // self.heads not in HEAD_DIMS:
            raise ValueError(
                f"model.cross_attention=triton needs a head dim (model.dim / model.heads) "
                f"in {HEAD_DIMS}, got {self.dim // self.heads}"
            )
        if self.attention == "cudnn":
            from freescale.kernels.attention.cudnn_sdpa import head_dim_problem

            why = head_dim_problem(self.dim // self.heads)
            if why:
                raise ValueError(f"model.attention=cudnn needs {why}: model.dim / model.heads")


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
    # Both patterns padded (what an exported program runs; tests set it eagerly).
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

        Under `torch.export` both patterns run padded (`padded_attention`): the
        one path that is a single program for every batch shape."""
        uih_off, cand_off = batch.uih.offsets, batch.candidates.offsets
        if torch.compiler.is_exporting() or self.padded:
            return padded_layouts(batch, max_uih, max_candidates)
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


class SequenceModel(RecModel):
    """``model(batch) -> logits``, one per candidate, aligned with ``batch.labels``.

    Written against the model contract (`freescale.models.contract`): the item
    table is its one sharded module, looked up once per step; the blocks are
    its capturable stack and its compiled regions."""

    sharded_modules = ("item_emb",)
    block_stack = "blocks"
    compile_regions = ("blocks",)  # each block (`dense.compile`)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.item_emb = nn.Embedding(cfg.num_items, cfg.dim)
        # A handful of rows: its CUDA backward is two kernels, not torch's ~30.
        self.action_emb = SmallEmbedding(cfg.num_actions, cfg.dim)
        self.dense_proj = nn.Linear(cfg.dense_dim, cfg.dim) if cfg.dense_dim else None
        blocks = [Block(cfg, i) for i in range(cfg.layers)]
        self.blocks = BlockStack(blocks, cfg.attention, cfg.cross_attention)
        self.head = nn.Sequential(nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, 1))
        nn.init.normal_(self.item_emb.weight, std=0.05)
        nn.init.normal_(self.action_emb.weight, std=0.05)
        self.sample_dropout = SampleDropout(cfg.emb_dropout, cfg.attn_dropout, cfg.ffn_dropout)

    def forward(self, batch: SampleBatch) -> Tensor:
        """``batch.max_lengths`` (host ints), when known, spare the GPU path a read-back."""
        max_uih, max_candidates = batch.max_lengths or (None, None)
        n_u, n_c = batch.uih[UIH_IDS].numel(), batch.num_candidates_total
        rows = self.item_emb(self.embedding_inputs(batch)["item_emb"])
        # One split, not three slices: its backward is one concatenation, where
        # each slice's would zero a full-size gradient, copy into it, and add.
        uih_rows, cand_rows, content_rows = rows.split([n_u, n_c, rows.shape[0] - n_u - n_c])
        uih = uih_rows + self.action_emb(batch.uih[UIH_ACTIONS])
        cand = cand_rows + self._pool_content(content_rows, batch)
        if self.dense_proj is not None and batch.dense is not None:
            per_cand = segment_ids(batch.candidates.offsets, n_c)
            cand = cand + self.dense_proj(batch.dense)[per_cand]
        drop = self.sample_dropout.for_batch(batch, self.training)
        if drop is None:  # a replaced block stack (dense.graphs) takes no dropout
            cand = self.blocks(uih, cand, batch, max_uih, max_candidates)
        else:
            uih = drop(uih, "uih", "emb")
            cand = self.blocks(uih, cand, batch, max_uih, max_candidates, drop)
        return self.head(cand).squeeze(-1)

    def attention_layouts(
        self,
        batch: SampleBatch,
        on_cuda: bool,
        max_uih: int | None = None,
        max_candidates: int | None = None,
    ) -> tuple[AttentionLayout, AttentionLayout]:
        """`BlockStack.layouts` of this model's blocks."""
        return self.blocks.layouts(batch, on_cuda, max_uih, max_candidates)

    def embedding_inputs(self, batch: SampleBatch) -> dict[str, Tensor]:
        """The ids each embedding module will be called with for ``batch``.

        Pipelines use it to start the ids exchange of a *future* batch early
        (TorchRec's sparse data dist); `forward` uses it too, so the two can't
        drift apart. One lookup per step: a sharded table then does one
        exchange, not three.
        """
        ids = [batch.uih[UIH_IDS], batch.candidates[CAND_IDS], batch.content[CONTENT_IDS]]
        return {"item_emb": torch.cat(ids)}

    def _pool_content(self, content_rows: Tensor, batch: SampleBatch) -> Tensor:
        return mean_content(content_rows, batch)

    def flops(self, batch: SampleBatch) -> float:
        """Matmul FLOPs of a training step on ``batch`` (forward + backward = 3 × forward).

        2 FLOPs per multiply-add, every matmul of `forward` once, D = dim, r = mlp_ratio:

        - every block: ``qkv`` (D → 3D) over the history and candidate tokens (a
          candidate's keys and values are computed, then dropped); the
          cross-attention's Q·Kᵀ and A·V (2·D multiply-adds per query-key pair)
          over its pairs: each candidate with every event of its sample's history
          (Σ N·L); the candidates' ``proj`` (D → D) and MLP (D → rD → D);
        - every block but the last (its history update has no reader): the causal
          self-attention over L(L+1)/2 pairs per sample (what the varlen kernel
          computes; the CPU reference's full masked L × L products count more),
          the history's ``proj`` and MLP;
        - ``dense_proj`` once per sample, the head (D → 1) once per candidate.

        Lookups, pooling, norms and other elementwise work are not counted. It
        depends on the batch's sizes only; one host read of the lengths.
        """
        d, r, layers = self.cfg.dim, self.cfg.mlp_ratio, self.cfg.layers
        lengths, cands = batch.uih_lengths(), batch.num_candidates()
        pairs = torch.stack([(lengths * (lengths + 1)).sum() // 2, (lengths * cands).sum()])
        causal, cross = (float(x) for x in pairs.tolist())  # the one host read
        n_u, n_c = float(batch.uih[UIH_IDS].numel()), float(batch.num_candidates_total)
        qkv = 2 * d * 3 * d * (n_u + n_c) * layers
        per_token = 2 * d * d + 2 * 2 * d * r * d  # proj + the MLP's two layers
        cand_layer = per_token * n_c + 4 * d * cross
        uih_layer = per_token * n_u + 4 * d * causal
        forward = qkv + cand_layer * layers + uih_layer * (layers - 1) + 2 * d * n_c
        if self.dense_proj is not None and batch.dense is not None:
            forward += 2 * self.cfg.dense_dim * d * batch.batch_size
        return 3.0 * forward


def build(
    schema: DataSchema,
    dim: int = 64,
    heads: int = 2,
    layers: int = 2,
    attention: str = "auto",
    cross_attention: str = "auto",
    emb_dropout: float = 0.0,
    attn_dropout: float = 0.0,
    ffn_dropout: float = 0.0,
) -> SequenceModel:
    """The model factory (`freescale.models.contract`): tables sized by the data."""
    options = dict(
        dim=dim, heads=heads, layers=layers, attention=attention, cross_attention=cross_attention,
        emb_dropout=emb_dropout, attn_dropout=attn_dropout, ffn_dropout=ffn_dropout,
    )  # fmt: skip
    return SequenceModel(_config(schema.num_items, schema.num_actions, schema.dense_dim, **options))


def _config(num_items: int, num_actions: int, dense_dim: int, **options: object) -> ModelConfig:
    return ModelConfig(
        num_items=num_items,
        num_actions=num_actions,
        dense_dim=dense_dim,
        **options,  # type: ignore[arg-type]
    )


def check_options(**options: object) -> None:
    """ValueError (one line) for options `build` would refuse: the checks are
    `ModelConfig`'s, run without the data (the config calls this at start)."""
    params = inspect.signature(build).parameters
    unknown = sorted(set(options) - set(params) | ({"schema"} & set(options)))
    if unknown:
        known = ", ".join(p for p in params if p != "schema")
        raise ValueError(f"model: unknown option(s) {', '.join(unknown)}; the built-in "
                         f"model takes {known}")  # fmt: skip
    for name, value in options.items():
        default = params[name].default
        if isinstance(default, int) and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"model.{name} expects an int, got {value!r}")
        if isinstance(default, str) and not isinstance(value, str):
            raise ValueError(f"model.{name} expects a string, got {value!r}")
    _config(1, 1, 0, **options)


def with_defaults(options: dict[str, object]) -> dict[str, object]:
    """``options`` with `build`'s defaults for those not given."""
    params = inspect.signature(build).parameters
    return {**{k: p.default for k, p in params.items() if k != "schema"}, **options}


def check_attention_device(model: nn.Module, device: torch.device) -> None:
    """A one-line ValueError, at the start of a run, when a block stack of
    ``model`` asks for an attention ``device`` cannot run (``cudnn`` without
    the package or an sm90+ GPU); its first forward would raise it otherwise."""
    for module in model.modules():
        if isinstance(module, BlockStack):
            module.self_attention_impl(device if device.type == "cuda" else None)


def max_lengths(*offsets: Tensor) -> list[int]:
    """Longest segment of each layout (0 when it has none), in one host read."""
    if offsets[0].numel() < 2:
        return [0] * len(offsets)
    return torch.stack([(o[1:] - o[:-1]).max() for o in offsets]).tolist()
