"""A user's model, written from docs/your-model.md: an item table and a content table.

Both tables have the same dim and optimizer, so the trainer keeps them in one
store, laid end to end (items first). ``item_rows`` sizes the item table; a
user who hard-codes it below the data's ``num_items`` makes the mistake the
trainer must name instead of training on the content table's rows.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from freescale import DataSchema, RecModel, SampleBatch, segment_mean


class TwoTables(RecModel):
    sharded_modules = ("items", "content")

    def __init__(self, schema: DataSchema, dim: int = 8, item_rows: int | None = None) -> None:
        super().__init__()
        self.items = nn.Embedding(item_rows or schema.num_items, dim)
        self.content = nn.Embedding(schema.num_items, dim)
        self.score = nn.Linear(2 * dim, 1)

    def embedding_inputs(self, batch: SampleBatch) -> dict[str, Any]:
        items = torch.cat([batch.uih["item_ids"], batch.candidates["item_ids"]])
        return {"items": items, "content": batch.content["content_ids"]}

    def forward(self, batch: SampleBatch) -> Tensor:
        ids = self.embedding_inputs(batch)
        n_u, n_c = batch.uih["item_ids"].shape[0], batch.num_candidates_total
        items, content = self.items(ids["items"]), self.content(ids["content"])
        user = segment_mean(items[:n_u], batch.uih.offsets)
        cand = items[n_u:] + segment_mean(content, batch.content.offsets)
        owner = torch.repeat_interleave(
            torch.arange(batch.batch_size, device=cand.device),
            batch.num_candidates(),
            output_size=n_c,
        )
        return self.score(torch.cat([user[owner], cand], dim=-1)).squeeze(-1)


def build(schema: DataSchema, dim: int = 8, item_rows: int | None = None) -> TwoTables:
    return TwoTables(schema, dim=dim, item_rows=item_rows)
