"""The reference sequence recommendation model (single-device code).

tokens: UIH item + action embeddings; candidates: item embedding + mean of
their content embeddings (+ a projection of dense features) → a stack of
pre-norm blocks (UIH causal self-attention; candidate → UIH cross-attention;
MLPs) → one logit per candidate.

The blocks are `freescale.models.blocks`, the options `ModelConfig`
(`freescale.models.sequence_config`).

Distribution is applied from outside: the item table is a plain
``nn.Embedding`` looked up with one 1-D id tensor per step, so
`freescale.embedding.swap` can replace it with a sharded module.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn

from freescale.jagged.batch import CAND_IDS, CONTENT_IDS, UIH_ACTIONS, UIH_IDS, SampleBatch
from freescale.jagged.ops import segment_ids
from freescale.jagged.schema import DataSchema
from freescale.models.attention import AttentionLayout
from freescale.models.blocks import Block, BlockStack
from freescale.models.contract import RecModel
from freescale.models.dropout import SampleDropout
from freescale.models.pooling import mean_content
from freescale.models.sequence_config import ModelConfig
from freescale.models.small_embedding import SmallEmbedding


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
        self.objective = cfg.loss

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
    loss: str = "bce",
) -> SequenceModel:
    """The model factory (`freescale.models.contract`): tables sized by the data."""
    options = dict(
        dim=dim, heads=heads, layers=layers, attention=attention, cross_attention=cross_attention,
        emb_dropout=emb_dropout, attn_dropout=attn_dropout, ffn_dropout=ffn_dropout, loss=loss,
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
