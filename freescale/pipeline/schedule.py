"""What each training mode issues early, what it waits for, and where.

The trainer calls the same hooks in every mode; a mode is one small object
that decides what happens in them (step i, batch i+1 already known):

- ``upcoming(lookups of batch i+1)``, at the start of step i (every table
  the batch reads, as one call's features: `Trainer.lookup_features`).
  `sync`: nothing. `sdd` and `freescale`: the preflight exchange and the
  candidate count of i+1 (on GPUs their counts are copied to pinned memory
  at once, so the later read waits for that copy only).
- ``global_count(step i)``: `sync` all-reduces the count now (blocking);
  the others waited for the one issued a step earlier.
- ``after_forward()``: `sdd` issues the ids AllToAll of i+1 (it overlaps
  backward); `freescale` does the rest of i+1's prefetch (the ids exchange,
  the collision split, the lookup and send of i+1's rows); `sync` nothing.
  Where no count is left to read on the host (one rank, inputs checked by
  the loader), `upcoming` does this at once: the collision split is then
  queued before step i's forward, and backward's read of its counts does
  not wait for forward to finish (which left the GPU idle while backward
  was launched).
- backward (inside the embedding collection): `sync`/`sdd` exchange and
  apply the gradients of every row; `freescale` only the collision rows
  now, the rest at the start of step i+1.
- ``flush()`` (evaluation, the end, checkpoints): `freescale` applies its
  stash; the others have none.

All three compute the same numbers (tests/pipeline/test_train.py): a mode
changes when collectives run, never what they compute.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from freescale.pipeline.loader import BatchInfo


class Schedule:
    """`sync` ("vanilla TorchRec"): nothing is issued early."""

    def __init__(self, embeddings: Any, device: torch.device, timer: Any) -> None:
        self.embeddings, self.device, self.timer = embeddings, device, timer
        self._counts: deque[Any] = deque()  # issued count all-reduces, in step order

    def upcoming(self, features: dict[str, Any], info: BatchInfo) -> None:
        """The batch after the current one is known (its step is next)."""

    def after_forward(self) -> None:
        """Forward of the current step has been launched."""

    def flush(self) -> None:
        """Make the tables exact now (before evaluation, checkpoints, the end)."""

    def collision_counts(self) -> Tensor | None:
        """After step i: this rank's [C^i rows, rows of i+1, C^i ids, ids
        of i+1] as a device tensor (not read here), or None when the mode has none."""
        return None

    def global_count(self, info: BatchInfo) -> int | Tensor:
        """The step's global candidate count (the loss normalizer)."""
        if info.global_candidates is not None:  # the balancer gathered it already
            return info.global_candidates
        with self.timer("meta"):
            count, work = self._counts.popleft() if self._counts else self._issue_count(info)
            if work is not None:
                work.wait()
            return count  # stays on the device: the loss divides by it without a host read

    def _issue_count(self, info: BatchInfo) -> tuple[Tensor, Any]:
        # A fill kernel carries the value: no pinned staging tensor and copy per step.
        count = torch.full((1,), info.candidates, dtype=torch.int64, device=self.device)
        if dist.get_world_size() == 1:  # the sum of one rank's count is that count
            return count, None
        return count, dist.all_reduce(count, async_op=True)

    def _prefetch(self, features: dict[str, Any], info: BatchInfo) -> None:
        self.embeddings.prefetch(features)  # every table of the step: one exchange
        if info.global_candidates is None:
            self._counts.append(self._issue_count(info))


class SparseDataDist(Schedule):
    """`sdd` (TorchRec's sparse data dist): the ids exchange of step i+1
    overlaps step i; its counts are read after step i's forward."""

    def upcoming(self, features: dict[str, Any], info: BatchInfo) -> None:
        self._prefetch(features, info)
        if not self.embeddings.prefetch_waits_for_gpu():  # counts known: no reason to wait
            self.embeddings.prefetch_ids()

    def after_forward(self) -> None:
        self.embeddings.prefetch_ids()  # next batch's ids AllToAll overlaps backward


class Prioritized(SparseDataDist):
    """`freescale` (paper Algorithm 2): step i+1's embeddings are looked up
    during step i except the collision rows, which step i's backward updates
    and sends; the rest of step i's update is applied at the start of step i+1.

    The hooks are sdd's: in prioritized mode the collection's ``prefetch`` issues
    i+1's preflight and ``prefetch_ids`` (after forward) does the rest of its
    prefetch, so the one host read waits for that exchange while the GPU works
    on forward. The collection is put in prioritized mode where it is built
    (`freescale.pipeline.sparse.SparseSide`)."""

    def flush(self) -> None:
        self.embeddings.flush()

    def collision_counts(self) -> Tensor | None:
        stats = self.embeddings.collision_stats()
        if stats is None:
            return None
        return torch.stack([stats.rows, stats.rows_next, stats.ids, stats.ids_next]).double()


SCHEDULES = {"sync": Schedule, "sdd": SparseDataDist, "freescale": Prioritized}
