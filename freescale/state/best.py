"""``evaluation.keep_best``: the weights of the best validation evaluation, and early stopping.

Every evaluation during training then covers the whole validation split. A
new best (strictly higher metric) copies this rank's weights: the dense
model's state and the local rows of every sharded table (no collective;
every rank does it at the same evaluations, their metrics being all-reduced).
Before the final evaluation they are put back, so it, the summary and an
exported state dict are those of the best evaluation, reported as the
summary's ``eval.best = {metric, value, step, epoch, stopped_early}``. With
``evaluation.patience = N`` the run stops after N evaluations in a row
without a new best.

The copies live in memory only: a checkpoint does not hold them, so a
resumed run could not know an earlier best; ``checkpoint.resume`` with
``keep_best`` is refused at start (`TrainConfig`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from freescale.config import EvaluationSection
from freescale.state.run_state import DenseState


class BestWeights:
    """Track ``section.keep_best`` over evaluations; keep the best weights."""

    def __init__(self, section: EvaluationSection, dense: DenseState, embeddings: Any) -> None:
        self.metric, self.patience = section.keep_best, section.patience
        self.dense, self.stores = dense, list(embeddings.stores)
        self.value: float | None = None
        self.step = -1
        self.since_best = 0  # evaluations since the best
        self._dense: dict[str, Tensor] = {}
        self._tables: list[Tensor] = []

    def observe(self, step: int, metrics: dict[str, Any]) -> None:
        """An evaluation after step ``step`` (0-based) gave ``metrics``."""
        value = float(metrics[self.metric])
        if self.value is not None and not value > self.value:
            self.since_best += 1
            return
        self.value, self.step, self.since_best = value, step, 0
        self._dense = {k: v.detach().clone() for k, v in self.dense.state_dict().items()}
        self._tables = [self._weight(store).clone() for store in self.stores]

    @property
    def stop(self) -> bool:
        """Early stopping: ``patience`` evaluations without a new best."""
        return bool(self.patience) and self.since_best >= self.patience

    def restore(self) -> None:
        """Put the best evaluation's weights back (nothing before any evaluation)."""
        if self.value is None:
            return
        self.dense.load_state_dict(self._dense)
        for store, saved in zip(self.stores, self._tables, strict=True):
            self._weight(store).copy_(saved)

    def report(self, steps_per_epoch: int | None) -> dict[str, Any]:
        out: dict[str, Any] = {"metric": self.metric, "value": self.value, "step": self.step + 1,
                               "stopped_early": self.stop}  # fmt: skip
        if steps_per_epoch:
            out["epoch"] = (self.step + 1) / steps_per_epoch
        return out

    @staticmethod
    def _weight(store: Any) -> Tensor:
        store.join_update()  # a pending fused update first
        return store.weight
