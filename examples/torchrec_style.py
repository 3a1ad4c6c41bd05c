"""A model written the TorchRec way: one ``EmbeddingCollection``, fed a KJT.

Two tables, one of them shared by two features (``items`` is read by the
history's and the candidates' item ids), as `torchrec.EmbeddingConfig`'s
``feature_names`` declare; the model builds a ``KeyedJaggedTensor`` from the
batch and pools the history per sample. Nothing FreeScale-specific but the
three contract attributes (`sharded_modules`, `embedding_inputs`, the
factory): FreeScale swaps the collection for a sharded one and looks every
table up in one exchange per step.

    freescale train --set model=examples.torchrec_style:build --mode freescale

Needs TorchRec (`pip install freescale[torchrec]`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torchrec import EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor

from freescale import DataSchema, RecModel, SampleBatch

KEYS = ("uih_items", "cand_items", "uih_actions")


class TorchRecStyleModel(RecModel):
    sharded_modules = ("ec",)

    def __init__(self, schema: DataSchema, dim: int = 16) -> None:
        super().__init__()
        self.ec = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name="item_table",
                    embedding_dim=dim,
                    num_embeddings=schema.num_items,
                    feature_names=["uih_items", "cand_items"],  # one table, two features
                ),
                EmbeddingConfig(
                    name="action_table",
                    embedding_dim=dim,
                    num_embeddings=schema.num_actions,
                    feature_names=["uih_actions"],
                ),
            ],
            device=torch.get_default_device(),
        )
        self.score = nn.Sequential(nn.Linear(2 * dim, dim), nn.ReLU(), nn.Linear(dim, 1))

    def kjt(self, batch: SampleBatch) -> KeyedJaggedTensor:
        uih, cand = batch.uih, batch.candidates
        return KeyedJaggedTensor(
            keys=list(KEYS),
            values=torch.cat([uih["item_ids"], cand["item_ids"], uih["actions"]]),
            lengths=torch.cat([uih.lengths(), cand.lengths(), uih.lengths()]),
        )

    def embedding_inputs(self, batch: SampleBatch) -> dict[str, Any]:
        return {"ec": self.kjt(batch)}

    def forward(self, batch: SampleBatch) -> Tensor:
        out = self.ec(self.kjt(batch))  # {feature: torchrec JaggedTensor}
        history = out["uih_items"].values() + out["uih_actions"].values()
        lengths = batch.uih.lengths()
        owner = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=history.device), lengths
        )
        user = history.new_zeros(lengths.numel(), history.shape[1]).index_add(0, owner, history)
        user = user / lengths.clamp(min=1).unsqueeze(-1).to(user.dtype)
        cand = out["cand_items"].values()
        per_cand = torch.repeat_interleave(
            torch.arange(batch.batch_size, device=cand.device), batch.num_candidates()
        )
        return self.score(torch.cat([user[per_cand], cand], dim=-1)).squeeze(-1)


def build(schema: DataSchema, dim: int = 16) -> TorchRecStyleModel:
    return TorchRecStyleModel(schema, dim)
