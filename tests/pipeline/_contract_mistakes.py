"""A user's model (tests/pipeline/_two_tables.py) with one contract mistake each,
chosen by the factory's ``mistake`` option, as a user would make them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from freescale import DataSchema, SampleBatch
from tests.pipeline._two_tables import TwoTables


class PerSample(TwoTables):
    def forward(self, batch: SampleBatch) -> Tensor:  # one logit per sample, not per candidate
        logits = super().forward(batch)
        return torch.zeros(batch.batch_size).index_add(0, _owner(batch), logits)


class ForgotContent(TwoTables):
    def embedding_inputs(self, batch: SampleBatch) -> dict[str, Any]:
        return {"items": super().embedding_inputs(batch)["items"]}  # no "content"


class NotFinite(TwoTables):
    def forward(self, batch: SampleBatch) -> Tensor:
        return super().forward(batch) / 0.0


class Integer(TwoTables):
    def forward(self, batch: SampleBatch) -> Tensor:
        return (super().forward(batch) > 0).long()  # a prediction, not a logit


class VectorLoss(TwoTables):
    def loss(self, logits: Tensor, batch: SampleBatch, normalizer: Any) -> tuple[Tensor, Tensor]:
        each = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, batch.labels, reduction="none"
        )
        return each / normalizer, each.detach().sum()  # forgot the .sum()


MISTAKES = {
    "per_sample": PerSample,
    "forgot_content": ForgotContent,
    "not_finite": NotFinite,
    "integer": Integer,
    "vector_loss": VectorLoss,
}


def _owner(batch: SampleBatch) -> Tensor:
    return torch.repeat_interleave(torch.arange(batch.batch_size), batch.num_candidates())


def build(schema: DataSchema, mistake: str = "per_sample", dim: int = 8) -> TwoTables:
    return MISTAKES[mistake](schema, dim=dim)
