"""Evaluation during and after training, from the ``evaluation`` section.

Synthetic data: NE on held-out samples (every rank its slice, sums
all-reduced). File data: ranking metrics (`freescale.pipeline.evaluation`)
of the first ``batches`` validation batches, and at the end every user of
the validation and test splits with the popularity baseline.
``keep_best``: the final evaluation is that of the best weights
(`freescale.state.best`), reported as ``best``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from freescale.config import EvaluationSection
from freescale.models.loss import bce_sum, normalized_entropy
from freescale.pipeline.evaluation import evaluate_split, popularity_baseline
from freescale.state.best import BestWeights
from freescale.state.run_state import DenseState

EVAL_STEP_OFFSET = 10_000_000  # held-out synthetic samples: far from any training step


def best_weights(
    section: EvaluationSection, model: nn.Module, source: Any, embeddings: Any
) -> BestWeights | None:
    """The best evaluation's weights that ``evaluation.keep_best`` keeps (else
    None): built before the evaluator and the run state, which both hold them."""
    if not section.keep_best:
        return None
    if not hasattr(source, "eval_batch"):
        raise ValueError("evaluation.keep_best needs file data (data=sasrec:PATH, ...)")
    return BestWeights(section, DenseState(model, embeddings), embeddings)


class Evaluator:
    """``heldout()`` every ``every`` steps, ``final()`` at the end.

    ``schedule`` is flushed first (the tables as sync training would have
    them); ``embeddings`` answers lookups without prefetch meanwhile."""

    def __init__(
        self,
        section: EvaluationSection,
        model: nn.Module,
        source: Any,
        embeddings: Any,
        schedule: Any,
        rank: int,
        world: int,
        batch_size: int,
        device: torch.device,
        best: BestWeights | None = None,
        samples_before: Callable[[int], int] | None = None,
    ) -> None:
        """``best``: `best_weights`; ``samples_before(step)``: training samples
        consumed before ``step``, all ranks, resumed segments at other world
        sizes included (the best's epoch)."""
        self.section, self.model, self.source = section, model, source
        self.samples_before = samples_before
        self.embeddings, self.schedule = embeddings, schedule
        self.rank, self.world, self.batch_size, self.device = rank, world, batch_size, device
        self.best = best

    @property
    def stop(self) -> bool:
        """``evaluation.patience`` evaluations without a new best (early stopping)."""
        return self.best is not None and self.best.stop

    @property
    def skipped(self) -> str:
        """Why this source is not evaluated ('' when it is): streamed data
        without a split directory (`freescale.data.parquet_stream`)."""
        return getattr(self.source, "no_evaluation", "")

    def due(self, step: int, steps: int) -> bool:
        if self.skipped:
            return False
        every = self.section.every
        return bool(every) and ((step + 1) % every == 0 or step + 1 == steps)

    @property
    def ranked(self) -> bool:
        """File data: evaluation ranks held-out items (`freescale.pipeline.evaluation`)."""
        return hasattr(self.source, "eval_batch")

    @torch.no_grad()
    def heldout(self, step: int | None = None) -> dict[str, float]:
        """NE on held-out samples; file data: ranking metrics of the first
        batches (keep_best: of the whole split, after training step ``step``)."""
        self.schedule.flush()
        with self.embeddings.prefetch_disabled():
            if self.best is not None:
                metrics = self._split("valid")
                if step is not None:
                    self.best.observe(step, metrics)
                return metrics
            if self.ranked:
                return self._split("valid", self.section.batches)
            totals = torch.zeros(3, dtype=torch.float64, device=self.device)
            for k in range(self.section.batches):
                batch = self.source.batch(
                    EVAL_STEP_OFFSET + k, self.rank, self.world, self.batch_size
                ).to(self.device)
                logits = self.model(batch)
                totals += torch.tensor(
                    [
                        bce_sum(logits, batch.labels),
                        float(batch.labels.sum()),
                        batch.num_candidates_total,
                    ],
                    dtype=torch.float64,
                    device=self.device,
                )
        dist.all_reduce(totals)
        s, p, n = totals.tolist()
        return {"ne": normalized_entropy(s, p, n), "candidates": n}

    @torch.no_grad()
    def final(self) -> dict[str, Any]:
        """File data: every user of the validation and test splits, and (rank 0)
        the popularity baseline on the test split; empty for synthetic data."""
        if self.skipped:
            return {"skipped": self.skipped}
        if not self.ranked:
            return {}
        self.schedule.flush()
        if self.best is not None:
            self.best.restore()
        with self.embeddings.prefetch_disabled():
            out: dict[str, Any] = {split: self._split(split) for split in ("valid", "test")}
        if self.best is not None:
            out["best"] = self.best.report(self._epoch(self.best.step + 1))
        if self.rank == 0:
            out["popularity_test"] = popularity_baseline(self.source, "test")
            out["data"] = self.source.split_counts()
        return out

    def _epoch(self, steps: int) -> float | None:
        """Passes over the training samples in the run's first ``steps`` steps."""
        total = self.source.split_counts()["train_samples"]
        if self.samples_before is not None and total:
            return self.samples_before(steps) / total
        per = self.source.steps_per_epoch(self.world, self.batch_size)
        return steps / per if per else None

    def _split(self, split: str, max_steps: int | None = None) -> dict[str, Any]:
        return evaluate_split(
            self.model, self.source, split, self.rank, self.world, self.batch_size,
            self.device, max_steps=max_steps,
        )  # fmt: skip
