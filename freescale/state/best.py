"""``evaluation.keep_best``: the weights of the best validation evaluation, and early stopping.

Every evaluation during training then covers the whole validation split. A
new best (strictly higher metric) copies this rank's weights: the dense
model's state and the local rows of every sharded table (no collective;
every rank does it at the same evaluations, their metrics being all-reduced).
Before the final evaluation they are put back, so it, the summary and an
exported state dict are those of the best evaluation, reported as the
summary's ``eval.best = {metric, value, step, epoch, stopped_early}``. With
``evaluation.patience = N`` the run stops after N evaluations in a row
without a new best; no checkpoint is written at that step (resumed there, a
run would train on), so a restart replays from the one before to the same stop.

A checkpoint holds them (`freescale.state.checkpoint`): `state_dict` (metric,
value, step, evaluations since, the dense copy; in ``trainer.pt``) and
`tables` (the best rows, resharded as the live tables are). A resumed run
goes on from that best, its patience count included. A checkpoint without
one (written before the first evaluation, without ``keep_best``, or for
another metric) resumes with no best; a run without ``keep_best`` ignores it.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from freescale.config import EvaluationSection
from freescale.embedding.state.checkpoint import WeightCopies
from freescale.state.run_state import DenseState


class BestWeights:
    """Track ``section.keep_best`` over evaluations; keep the best weights."""

    def __init__(self, section: EvaluationSection, dense: DenseState, embeddings: Any) -> None:
        self.metric, self.patience = section.keep_best, section.patience
        self.dense, self.embeddings, self.stores = dense, embeddings, list(embeddings.stores)
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

    def report(self, epoch: float | None) -> dict[str, Any]:
        """``epoch``: the best's, in passes over the training samples (the caller knows them)."""
        out: dict[str, Any] = {"metric": self.metric, "value": self.value, "step": self.step + 1,
                               "stopped_early": self.stop}  # fmt: skip
        if epoch is not None:
            out["epoch"] = epoch
        return out

    def state_dict(self) -> dict[str, Any]:
        """The best so far, plain and equal on every rank (rank 0 saves it); no
        ``value`` before the first evaluation. Its rows: `tables`."""
        out: dict[str, Any] = {"metric": self.metric, "since_best": self.since_best}
        if self.value is not None:
            out.update(value=self.value, step=self.step, dense=self._dense)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's best (another metric's is none); `tables` then
        receives its rows."""
        if state.get("metric") != self.metric or "value" not in state:
            return
        self.value, self.step = float(state["value"]), int(state["step"])
        self.since_best, self._dense = int(state["since_best"]), dict(state["dense"])
        self._tables = [self._weight(store).clone() for store in self.stores]  # `tables` fills

    def tables(self) -> nn.Module | None:
        """The best rows as checkpoint entries (`WeightCopies`); None without a best."""
        return None if self.value is None else WeightCopies(self.embeddings, self._tables)

    @staticmethod
    def _weight(store: Any) -> Tensor:
        store.join_update()  # a pending fused update first
        return store.weight
