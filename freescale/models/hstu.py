"""An HSTU-style model (Zhai et al. 2024): a second built-in of another family.

Tokens as in the reference model (`sequence.py`): a history event is its
item + action embedding; a candidate is its item embedding + the mean of its
content embeddings (+ a projection of the sample's dense features). Each
layer, with weights shared by history and candidate tokens, is HSTU's::

    U, V, Q, K = split(SiLU(f1(LayerNorm(X))))
    A          = SiLU(α·Q·Kᵀ + rab) / N            (pointwise, not softmax)
    Y          = f2(LayerNorm(A·V) ⊙ U) + X

with the attention patterns of `hstu_attention` (history: causal within the
sample; candidate: the sample's whole history and itself, never the other
candidates; ``rab`` from log-bucketed relative positions and times; ``N`` the
history length + 1). So a candidate is scored like a target appended after
its sample's history, as in HSTU's ranking setup, each target masked from
the others. A LayerNorm and a linear head turn each candidate's final token
into its logit. The last layer skips the history update nobody reads.

Written against the model contract (`contract.py`): the item table is its one
sharded module, looked up once per step over the concatenated history,
candidate and content ids; the action and bias tables are small and
replicated. Samples are independent (the load balancer may move them).
``attention``: ``fused`` (Triton kernels on the packed rows; ``auto`` on
CUDA), ``padded`` (the batch padded to its longest history; ``auto`` on the
CPU) or ``reference`` (a loop over samples, for checking).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from freescale.jagged.batch import (
    CAND_IDS,
    CONTENT_IDS,
    UIH_ACTIONS,
    UIH_IDS,
    UIH_TIMESTAMPS,
    SampleBatch,
)
from freescale.jagged.ops import segment_ids
from freescale.jagged.schema import DataSchema
from freescale.models import hstu_attention as hattn
from freescale.models.contract import RecModel, check_objective
from freescale.models.dropout import RowDropout, SampleDropout, check_rate
from freescale.models.pooling import mean_content
from freescale.models.small_embedding import SmallEmbedding

CAND_TIMESTAMPS = "timestamps"  # optional candidate feature: when it is shown


@dataclass(frozen=True)
class HSTUConfig:
    num_items: int = 10_000
    num_actions: int = 4
    dim: int = 64
    heads: int = 2
    layers: int = 2
    dense_dim: int = 0
    attention: str = "auto"  # auto | reference | padded | fused
    # dropout (`freescale.models.dropout`, training steps only): on the history's
    # embeddings, on each layer's gated attention output (LayerNorm(A·V) ⊙ U,
    # where HSTU's reference drops) and on its f2 output before the residual
    emb_dropout: float = 0.0
    attn_dropout: float = 0.0
    ffn_dropout: float = 0.0
    # the training loss (`RecModel.loss`): bce per candidate, or softmax over
    # each sample's candidates (one positive against its sampled negatives)
    loss: str = "bce"

    def __post_init__(self) -> None:
        for name in ("emb_dropout", "attn_dropout", "ffn_dropout"):
            check_rate(name, getattr(self, name))
        check_objective(self.loss)
        for name in ("num_items", "num_actions", "dim", "heads", "layers"):
            if getattr(self, name) < 1:
                raise ValueError(f"hstu {name} must be >= 1, got {getattr(self, name)}")
        if self.dim % self.heads:
            raise ValueError(f"hstu dim ({self.dim}) must be divisible by heads ({self.heads})")
        if self.dense_dim < 0:
            raise ValueError("hstu dense_dim must be >= 0")
        hattn.resolve_impl(self.attention)  # validates the name


class HSTULayer(nn.Module):
    """One HSTU layer over the history and candidate tokens (see the module docstring)."""

    def __init__(self, cfg: HSTUConfig, layer: int = 0) -> None:
        super().__init__()
        d, self.heads, self.head_dim, self.layer = cfg.dim, cfg.heads, cfg.dim // cfg.heads, layer
        self.norm_in, self.norm_attn = nn.LayerNorm(d), nn.LayerNorm(d)
        self.f1, self.f2 = nn.Linear(d, 4 * d), nn.Linear(d, d)
        self.bias = hattn.RelativeBias()

    def _uvqk(self, x: Tensor) -> tuple[Tensor, ...]:
        u, v, q, k = F.silu(self.f1(self.norm_in(x))).chunk(4, dim=-1)
        return (u, *(t.unflatten(-1, (self.heads, self.head_dim)) for t in (v, q, k)))

    def forward(
        self,
        uih: Tensor,
        cand: Tensor,
        layout: hattn.ReferenceLayout | hattn.PaddedLayout | hattn.FusedLayout,
        uih_out: bool = True,
        drop: RowDropout | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``uih_out=False`` (the last layer): ``uih`` comes back unchanged.
        ``drop``: this step's dropout (None: none)."""
        u_u, v_u, q_u, k_u = self._uvqk(uih)
        u_c, v_c, q_c, k_c = self._uvqk(cand)
        att_u, att_c = layout.attend(self.bias, (q_u, k_u, v_u), (q_c, k_c, v_c), uih_out)
        cand = cand + self._out(self.norm_attn(att_c.flatten(1)) * u_c, "cand", drop)
        if att_u is not None:
            uih = uih + self._out(self.norm_attn(att_u.flatten(1)) * u_u, "uih", drop)
        return uih, cand

    def _out(self, gated: Tensor, rows: str, drop: RowDropout | None) -> Tensor:
        if drop is None:
            return self.f2(gated)
        return drop(self.f2(drop(gated, rows, "attn", self.layer)), rows, "ffn", self.layer)


class HSTUModel(RecModel):
    """``model(batch) -> logits``, one per candidate, aligned with ``batch.labels``."""

    sharded_modules = ("item_emb",)
    compile_regions = ("layers",)  # each layer (`dense.compile`; its attention traces too)

    def __init__(self, cfg: HSTUConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.item_emb = nn.Embedding(cfg.num_items, cfg.dim)
        self.action_emb = SmallEmbedding(cfg.num_actions, cfg.dim)
        self.dense_proj = nn.Linear(cfg.dense_dim, cfg.dim) if cfg.dense_dim else None
        self.layers = nn.ModuleList(HSTULayer(cfg, i) for i in range(cfg.layers))
        self.head = nn.Sequential(nn.LayerNorm(cfg.dim), nn.Linear(cfg.dim, 1))
        nn.init.normal_(self.item_emb.weight, std=0.05)
        nn.init.normal_(self.action_emb.weight, std=0.05)
        self.sample_dropout = SampleDropout(cfg.emb_dropout, cfg.attn_dropout, cfg.ffn_dropout)
        self.objective = cfg.loss

    def embedding_inputs(self, batch: SampleBatch) -> dict[str, Tensor]:
        """One lookup per step: history, candidate and content ids, concatenated."""
        ids = [batch.uih[UIH_IDS], batch.candidates[CAND_IDS], batch.content[CONTENT_IDS]]
        return {"item_emb": torch.cat(ids)}

    def forward(self, batch: SampleBatch) -> Tensor:
        n_u, n_c = batch.uih[UIH_IDS].numel(), batch.num_candidates_total
        rows = self.item_emb(self.embedding_inputs(batch)["item_emb"])
        uih_rows, cand_rows, content_rows = rows.split([n_u, n_c, rows.shape[0] - n_u - n_c])
        uih = uih_rows + self.action_emb(batch.uih[UIH_ACTIONS])
        cand = cand_rows + mean_content(content_rows, batch)
        if self.dense_proj is not None and batch.dense is not None:
            cand = cand + self.dense_proj(batch.dense)[segment_ids(batch.candidates.offsets, n_c)]
        layout = self.layout(batch)
        drop = self.sample_dropout.for_batch(batch, self.training)
        if drop is not None:
            uih = drop(uih, "uih", "emb")
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            uih, cand = layer(uih, cand, layout, uih_out=i < last, drop=drop)
        return self.head(cand).squeeze(-1)

    def layout(
        self, batch: SampleBatch
    ) -> hattn.ReferenceLayout | hattn.PaddedLayout | hattn.FusedLayout:
        """The attention layout of ``batch``, once per forward (every layer shares
        it); history timestamps missing from the data count as all 0."""
        impl = hattn.resolve_impl(self.cfg.attention, batch.uih.offsets.is_cuda)
        uih_times = batch.uih.features.get(UIH_TIMESTAMPS)
        if uih_times is None:
            uih_times = torch.zeros_like(batch.uih[UIH_IDS])
        return hattn.layout(
            impl,
            batch.uih.offsets,
            batch.candidates.offsets,
            uih_times,
            batch.candidates.features.get(CAND_TIMESTAMPS),
            batch.num_candidates_total,
            batch.max_lengths,
        )

    def flops(self, batch: SampleBatch) -> float:
        """Matmul FLOPs of a training step (forward + backward = 3 × forward).

        2 FLOPs per multiply-add; per layer: f1 (D → 4D) over every token,
        f2 (D → D) over the tokens updated, and attention's two products
        (Q·Kᵀ and A·V, 2·D multiply-adds per query-key pair) over the pairs
        the formula uses: L(L+1)/2 causal history pairs per sample (what a
        kernel skipping masked work does; the padded path computes more) and
        L+1 keys per candidate. Elementwise work and lookups are not counted.
        The last layer updates candidates only. One host read of the lengths.
        """
        d, layers = self.cfg.dim, self.cfg.layers
        lengths = batch.uih_lengths().to(torch.float64)
        per_cand = lengths[segment_ids(batch.candidates.offsets, batch.num_candidates_total)]
        hist_pairs, cand_pairs = (lengths * (lengths + 1) / 2).sum(), (per_cand + 1).sum()
        n_u, n_c = float(batch.uih[UIH_IDS].numel()), float(batch.num_candidates_total)
        f1 = 2 * d * 4 * d * (n_u + n_c) * layers
        cand_layer = 2 * d * d * n_c + 4 * d * cand_pairs
        hist_layer = 2 * d * d * n_u + 4 * d * hist_pairs
        forward = f1 + cand_layer * layers + hist_layer * (layers - 1) + 2 * d * n_c
        if self.dense_proj is not None and batch.dense is not None:
            forward = forward + 2 * self.cfg.dense_dim * d * batch.batch_size
        return 3.0 * float(forward)


def build(
    schema: DataSchema,
    dim: int = 64,
    heads: int = 2,
    layers: int = 2,
    attention: str = "auto",
    emb_dropout: float = 0.0,
    attn_dropout: float = 0.0,
    ffn_dropout: float = 0.0,
    loss: str = "bce",
) -> HSTUModel:
    """The model factory (`freescale.models.contract`): tables sized by the data.

    ``--set model=freescale.models.hstu:build`` (options ``--set model.dim=...``)."""
    return HSTUModel(
        HSTUConfig(
            num_items=schema.num_items,
            num_actions=schema.num_actions,
            dim=dim,
            heads=heads,
            layers=layers,
            dense_dim=schema.dense_dim,
            attention=attention,
            emb_dropout=emb_dropout,
            attn_dropout=attn_dropout,
            ffn_dropout=ffn_dropout,
            loss=loss,
        )
    )
