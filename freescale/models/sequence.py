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

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from freescale.jagged.batch import CAND_IDS, CONTENT_IDS, UIH_ACTIONS, UIH_IDS, SampleBatch
from freescale.jagged.ops import segment_ids
from freescale.models.attention import jagged_attention


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

    def __post_init__(self) -> None:
        for name in ("num_items", "num_actions", "dim", "heads", "layers", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"model {name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"model dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.dense_dim < 0:
            raise ValueError("model dense_dim must be >= 0")


class Block(nn.Module):
    """Pre-norm block shared by UIH and candidate tokens (same weights)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, self.heads, self.impl = cfg.dim, cfg.heads, cfg.attention
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(
            nn.Linear(d, cfg.mlp_ratio * d), nn.GELU(), nn.Linear(cfg.mlp_ratio * d, d)
        )

    def _heads(self, x: Tensor) -> Tensor:
        return x.view(x.shape[0], self.heads, x.shape[-1] // self.heads)  # 0 rows work too

    def forward(
        self,
        uih: Tensor,
        cand: Tensor,
        uih_off: Tensor,
        cand_off: Tensor,
        max_uih: int | None,
        max_cand: int | None,
    ) -> tuple[Tensor, Tensor]:
        qu, ku, vu = self.qkv(self.norm1(uih)).chunk(3, dim=-1)
        qc = self.qkv(self.norm1(cand)).chunk(3, dim=-1)[0]
        qu, ku, vu, qc = (self._heads(t) for t in (qu, ku, vu, qc))
        self_att = jagged_attention(qu, ku, vu, uih_off, uih_off, True, max_uih, max_uih, self.impl)
        cross = jagged_attention(qc, ku, vu, cand_off, uih_off, False, max_cand, max_uih, self.impl)
        uih = uih + self.proj(self_att.flatten(1))
        cand = cand + self.proj(cross.flatten(1))
        return uih + self.mlp(self.norm2(uih)), cand + self.mlp(self.norm2(cand))


class SequenceModel(nn.Module):
    """``model(batch) -> logits``, one per candidate, aligned with ``batch.labels``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.item_emb = nn.Embedding(cfg.num_items, cfg.dim)
        self.action_emb = nn.Embedding(cfg.num_actions, cfg.dim)
        self.dense_proj = nn.Linear(cfg.dense_dim, cfg.dim) if cfg.dense_dim else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.head = nn.Sequential(nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, 1))
        nn.init.normal_(self.item_emb.weight, std=0.05)
        nn.init.normal_(self.action_emb.weight, std=0.05)

    def forward(
        self, batch: SampleBatch, max_uih: int | None = None, max_candidates: int | None = None
    ) -> Tensor:
        """``max_uih``/``max_candidates`` (host ints) spare the GPU path a read-back."""
        n_u, n_c = batch.uih[UIH_IDS].numel(), batch.num_candidates_total
        rows = self.item_emb(self.embedding_inputs(batch)["item_emb"])
        uih = rows[:n_u] + self.action_emb(batch.uih[UIH_ACTIONS])
        cand = rows[n_u : n_u + n_c] + self._pool_content(rows[n_u + n_c :], batch)
        if self.dense_proj is not None and batch.dense is not None:
            per_cand = segment_ids(batch.candidates.offsets, n_c)
            cand = cand + self.dense_proj(batch.dense)[per_cand]
        for block in self.blocks:
            uih, cand = block(
                uih, cand, batch.uih.offsets, batch.candidates.offsets, max_uih, max_candidates
            )
        return self.head(cand).squeeze(-1)

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
        """Mean of each candidate's content embeddings (zero when it has none)."""
        n_c = batch.num_candidates_total
        lengths = batch.candidate_lengths()
        owner = segment_ids(batch.content.offsets, content_rows.shape[0])
        sums = content_rows.new_zeros(n_c, content_rows.shape[1]).index_add(0, owner, content_rows)
        return sums / lengths.clamp(min=1).unsqueeze(-1).to(sums.dtype)
