"""A model FreeScale did not write: items + item categories, mean pooling, its own loss.

Written only against the public API (`freescale.RecModel`, `freescale.DataSchema`,
`freescale.Feature`, `freescale.SampleBatch`), the way a user would:

- two row-wise sharded tables, ``items`` and ``categories``, each called
  separately in ``forward`` (FreeScale still looks both up in one exchange
  per step);
- a category id per history event (``uih.category``) and per candidate
  (``candidates.category``), extra features of the data;
- a user vector = mean of the history's (item + category + action)
  embeddings; a candidate's score = an MLP of (user, candidate, their product);
- its own loss: binary cross-entropy against labels smoothed by ``smoothing``.

Train it (any mode, balancer, world size)::

    freescale train --set model=examples.categories:build \\
        --set data=examples.categories:data --set data.num_categories=50

or from Python (docs/your-model.md)::

    from examples.categories import build, data
    result = freescale.train(model=build, data=data(num_categories=50), run={"steps": 50})

or from a file with a category column (docs/train-on-your-data.md): write
one from a SASRec file, then read the column as features at both levels::

    python -m examples.categories beauty.txt /tmp/beauty.parquet 64
    freescale train --set model=examples.categories:build --set model.category=categories \\
        --set data=parquet:/tmp/beauty.parquet \\
        --set data.features=categories:uih,categories:candidates

The file's categories are a hash of the item id (``category_of``), not a
real catalogue: they carry no information about the item beyond its id, so
they show the plumbing, not a gain in accuracy.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from freescale import DataSchema, Feature, RecModel, SampleBatch, segment_mean
from freescale.data import LengthDistribution, SyntheticConfig, SyntheticSource

CATEGORY = "category"


class CategoryModel(RecModel):
    sharded_modules = ("items", "categories")

    def __init__(
        self, schema: DataSchema, dim: int = 32, smoothing: float = 0.05, category: str = CATEGORY
    ) -> None:
        super().__init__()
        self.category = category  # the features' name, at both levels
        self.items = nn.Embedding(schema.num_items, dim)
        self.categories = nn.Embedding(schema.rows("uih", category), dim)
        self.actions = nn.Embedding(schema.num_actions, dim)  # a few rows: replicated
        self.mlp = nn.Sequential(nn.Linear(3 * dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, 1))
        self.smoothing = smoothing
        for table in (self.items, self.categories, self.actions):
            nn.init.normal_(table.weight, std=0.05)

    def embedding_inputs(self, batch: SampleBatch) -> dict[str, Any]:
        uih, cand = batch.uih, batch.candidates
        return {
            "items": torch.cat([uih["item_ids"], cand["item_ids"]]),
            "categories": torch.cat([uih[self.category], cand[self.category]]),
        }

    def forward(self, batch: SampleBatch) -> Tensor:
        ids = self.embedding_inputs(batch)
        n_u = batch.uih["item_ids"].shape[0]
        cats = self.categories(ids["categories"])  # called separately, in any order
        items = self.items(ids["items"])
        history = items[:n_u] + cats[:n_u] + self.actions(batch.uih["actions"])
        user = segment_mean(history, batch.uih.offsets)
        cand = items[n_u:] + cats[n_u:]
        owner = torch.repeat_interleave(  # sized from shapes: one exportable program
            torch.arange(batch.batch_size, device=cand.device),
            batch.num_candidates(),
            output_size=cand.shape[0],
        )
        u = user[owner]
        return self.mlp(torch.cat([u, cand, u * cand], dim=-1)).squeeze(-1)

    def loss(self, logits: Tensor, batch: SampleBatch, normalizer: Any) -> tuple[Tensor, Tensor]:
        target = batch.labels.float() * (1 - self.smoothing) + 0.5 * self.smoothing
        total = F.binary_cross_entropy_with_logits(logits.float(), target, reduction="sum")
        return total / normalizer, total.detach()


def build(
    schema: DataSchema, dim: int = 32, smoothing: float = 0.05, category: str = CATEGORY
) -> CategoryModel:
    """The model factory: ``factory(schema, **options)``; ``category``: the
    name of the category features (``uih`` and ``candidates`` level)."""
    return CategoryModel(schema, dim=dim, smoothing=smoothing, category=category)


def category_of(ids: Any, num_categories: int) -> Any:
    """A fixed hash of an item id: same item, same category (no real catalogue)."""
    return (ids * 2654435761) % num_categories


class WithCategories:
    """A data source whose batches also carry each item's category (a hash of its id)."""

    def __init__(self, source: Any, num_categories: int) -> None:
        self.source, self.num_categories = source, num_categories
        self.num_items, self.num_actions = source.num_items, source.num_actions
        extra = (
            Feature(CATEGORY, "uih", num_categories),
            Feature(CATEGORY, "candidates", num_categories),
        )
        self.schema = DataSchema.standard(self.num_items, self.num_actions, extra)

    def category(self, ids: Tensor) -> Tensor:
        return category_of(ids, self.num_categories)

    def batch(self, step: int, rank: int, world_size: int, batch_size: int) -> SampleBatch:
        b = self.source.batch(step, rank, world_size, batch_size)
        b.uih.features[CATEGORY] = self.category(b.uih["item_ids"])
        b.candidates.features[CATEGORY] = self.category(b.candidates["item_ids"])
        return b

    def num_steps(self, world_size: int, batch_size: int) -> int | None:
        return self.source.num_steps(world_size, batch_size)


def data(
    num_categories: int = 50, num_items: int = 2_000, seed: int = 0, **synthetic: Any
) -> WithCategories:
    """The data factory: synthetic long-tail histories with categories."""
    config = SyntheticConfig(
        num_items=num_items,
        seed=seed,
        max_uih=64,
        lengths=LengthDistribution(median=24, sigma=0.8, cap=64),
        max_candidates=4,
        **synthetic,
    )
    return WithCategories(SyntheticSource(config), num_categories)


def write_parquet(src: str | Path, dst: str | Path, num_categories: int = 64) -> int:
    """A SASRec file (``user item`` lines, chronological per user) as Parquet:
    one row per user, in order of first appearance, with list columns
    ``items`` (the raw ids), ``timestamps`` (the line numbers, as the SASRec
    reader keeps them) and ``categories`` (``category_of`` the raw id); the
    Parquet reader then gives the same users, item ids and split as
    ``sasrec:SRC``. Returns the number of users."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from freescale.data.readers import check_file, parse_id, text_lines

    src = check_file(src)
    users: dict[int, tuple[list[int], list[int]]] = {}
    for line_no, line in text_lines(src):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 2:
            raise ValueError(f"{src}:{line_no}: expected 'user item', got {line.strip()!r}")
        user, item = (
            parse_id(src, line_no, what, t) for what, t in zip(("user", "item"), parts, strict=True)
        )
        items, stamps = users.setdefault(user, ([], []))
        items.append(item)
        stamps.append(line_no)
    histories = list(users.values())
    table = pa.table(
        {
            "user": list(users),
            "items": [h[0] for h in histories],
            "timestamps": [h[1] for h in histories],
            "categories": [
                category_of(np.asarray(h[0], dtype=np.uint64), num_categories).astype(np.int64)
                for h in histories
            ],
        }
    )
    pq.write_table(table, dst)
    return len(histories)


if __name__ == "__main__":
    if not 3 <= len(sys.argv) <= 4:
        sys.exit("usage: python -m examples.categories SRC.txt DST.parquet [N_CATEGORIES]")
    n = write_parquet(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:]))
    print(f"{sys.argv[2]}: {n} users, a hashed category per item")
