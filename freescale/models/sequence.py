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

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from freescale.jagged.batch import CAND_IDS, CONTENT_IDS, UIH_ACTIONS, UIH_IDS, SampleBatch
from freescale.jagged.ops import segment_ids
from freescale.jagged.schema import DataSchema
from freescale.models.attention import (
    AttentionLayout,
    attend,
    attention_layout,
    resolve_impl,
    segments,
)
from freescale.models.contract import RecModel
from freescale.models.graphs import BlockGraphs
from freescale.models.linear import Linear
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
    attention: str = "auto"  # auto | reference | varlen
    graphs: bool = False  # CUDA graphs of the block stack (`freescale.models.graphs`)
    graph_streams: int = 2  # 2: their candidate path on a side stream (same numbers)

    def __post_init__(self) -> None:
        for name in ("num_items", "num_actions", "dim", "heads", "layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"model dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.dense_dim < 0:
            raise ValueError("model dense_dim must be >= 0")
        if self.graph_streams not in (1, 2):
            raise ValueError(f"model graph_streams must be 1 or 2, got {self.graph_streams}")
        if self.graphs and self.attention == "reference":
            raise ValueError("model graphs need the varlen attention (attention=auto or varlen)")


class Block(nn.Module):
    """Pre-norm block shared by UIH and candidate tokens (same weights)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, self.heads, self.impl = cfg.dim, cfg.heads, cfg.attention
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # `Linear`: no memset node per bias gradient in the blocks' CUDA graphs.
        self.qkv, self.proj = Linear(d, 3 * d), Linear(d, d)
        self.mlp = nn.Sequential(
            Linear(d, cfg.mlp_ratio * d), nn.GELU(), Linear(cfg.mlp_ratio * d, d)
        )

    def _heads(self, x: Tensor) -> Tensor:
        return x.view(x.shape[0], self.heads, x.shape[-1] // self.heads)  # 0 rows work too

    def forward(
        self,
        uih: Tensor,
        cand: Tensor,
        layout: tuple[AttentionLayout, AttentionLayout],
        uih_out: bool = True,
        side: torch.cuda.Stream | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``layout``: (UIH self-attention, candidate cross-attention), from `attention_layouts`.

        ``uih_out=False`` (the last block): the UIH update has no reader, so it
        is skipped and ``uih`` comes back unchanged; the candidates' numbers
        are the same. ``side``: the candidate path runs on this CUDA stream,
        concurrently with the UIH path (same kernels, so the same numbers);
        the caller forks ``side`` from the current stream before the first
        block and joins it after the last (`graphs.run_blocks`)."""

        def on_side() -> AbstractContextManager[object]:
            return torch.cuda.stream(side) if side is not None else nullcontext()

        with on_side():
            qc = self._heads(self.qkv(self.norm1(cand)).chunk(3, dim=-1)[0])
        qu, ku, vu = (self._heads(t) for t in self.qkv(self.norm1(uih)).chunk(3, dim=-1))
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())  # the keys and values
            # Their memory (one storage: the qkv output) must not be reused until the
            # side stream is done with it (the cross-attention saves them for backward).
            ku.record_stream(side)
        with on_side():
            cand = cand + self.proj(attend(qc, ku, vu, layout[1]).flatten(1))
            cand = cand + self.mlp(self.norm2(cand))
        if uih_out:
            uih = uih + self.proj(attend(qu, ku, vu, layout[0]).flatten(1))
            uih = uih + self.mlp(self.norm2(uih))
        return uih, cand


class SequenceModel(RecModel):
    """``model(batch) -> logits``, one per candidate, aligned with ``batch.labels``.

    Written against the model contract (`freescale.models.contract`): the item
    table is its one sharded module, looked up once per step."""

    sharded_modules = ("item_emb",)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.item_emb = nn.Embedding(cfg.num_items, cfg.dim)
        # A handful of rows: its CUDA backward is two kernels, not torch's ~30.
        self.action_emb = SmallEmbedding(cfg.num_actions, cfg.dim)
        self.dense_proj = nn.Linear(cfg.dense_dim, cfg.dim) if cfg.dense_dim else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = nn.Sequential(nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, 1))
        self.graphs = (
            BlockGraphs(self.blocks, two_streams=cfg.graph_streams == 2) if cfg.graphs else None
        )
        nn.init.normal_(self.item_emb.weight, std=0.05)
        nn.init.normal_(self.action_emb.weight, std=0.05)

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
        if self._graphed(uih, cand, batch):
            assert self.graphs is not None
            if max_uih is None or max_candidates is None:
                max_uih, max_candidates = _max_lengths(batch.uih.offsets, batch.candidates.offsets)
            cand = self.graphs.run(
                uih, cand, batch.uih.offsets, batch.candidates.offsets, max_uih, max_candidates
            )
            return self.head(cand).squeeze(-1)
        layout = self.attention_layouts(batch, rows.is_cuda, max_uih, max_candidates)
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            uih, cand = block(uih, cand, layout, uih_out=i < last)
        return self.head(cand).squeeze(-1)

    def _graphed(self, uih: Tensor, cand: Tensor, batch: SampleBatch) -> bool:
        """Training steps on CUDA go through the graphs (when on); evaluation
        (no gradients) and batches without UIH tokens or candidates run eagerly."""
        return (
            self.graphs is not None
            and uih.is_cuda
            and torch.is_grad_enabled()
            and uih.shape[0] > 0
            and cand.shape[0] > 0
        )

    def attention_layouts(
        self,
        batch: SampleBatch,
        on_cuda: bool,
        max_uih: int | None = None,
        max_candidates: int | None = None,
    ) -> tuple[AttentionLayout, AttentionLayout]:
        """(UIH self-attention, candidate cross-attention) layouts, once per forward:
        every layer shares them. Maxima not given are read back in one host read."""
        impl = resolve_impl(self.cfg.attention, on_cuda)
        uih_off, cand_off = batch.uih.offsets, batch.candidates.offsets
        if impl == "varlen" and (max_uih is None or max_candidates is None):
            max_uih, max_candidates = _max_lengths(uih_off, cand_off)
        uih = segments(uih_off, impl, max_uih)
        cand = segments(cand_off, impl, max_candidates)
        return (
            attention_layout(uih, uih, True, batch.uih[UIH_IDS].numel()),
            attention_layout(cand, uih, False, batch.num_candidates_total),
        )

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


def build(
    schema: DataSchema,
    dim: int = 64,
    heads: int = 2,
    layers: int = 2,
    attention: str = "auto",
    graphs: bool = False,
    graph_streams: int = 2,
) -> SequenceModel:
    """The model factory (`freescale.models.contract`): tables sized by the data."""
    return SequenceModel(
        ModelConfig(
            num_items=schema.num_items,
            num_actions=schema.num_actions,
            dim=dim,
            heads=heads,
            layers=layers,
            dense_dim=schema.dense_dim,
            attention=attention,
            graphs=graphs,
            graph_streams=graph_streams,
        )
    )


def _max_lengths(*offsets: Tensor) -> list[int]:
    """Longest segment of each layout (0 when it has none), in one host read."""
    if offsets[0].numel() < 2:
        return [0] * len(offsets)
    return torch.stack([(o[1:] - o[:-1]).max() for o in offsets]).tolist()
