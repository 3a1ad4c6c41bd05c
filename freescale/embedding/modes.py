"""How a `ShardedEmbeddingCollection` runs its training lookups: the mode.

The mode is fixed when the collection is built
(``ShardedEmbeddingCollection(..., mode=Prioritized())``, `swap` likewise) and
holds everything that differs between the three training modes; the
collection itself has no mode branches. All three compute the same numbers:
a mode changes when exchanges run, never what they compute.

- `Sync` ("vanilla TorchRec"): each lookup exchanges its ids when it runs.
  Nothing can be prefetched.
- `SparseDataDist` (TorchRec's sparse data dist): ``prefetch(features)`` of
  a later call starts its input distribution (preflight now, ids AllToAll at
  `prefetch_ids`); calls are matched in order.
- `Prioritized` (paper Algorithm 2, `freescale.embedding.prioritized`):
  ``prefetch`` of step i+1, called before step i's backward, looks up every
  row step i does not update; only the collision rows wait for step i's
  update. At most one step ahead, one lookup call per step.

A prefetching mode (`prefetches`) looks a training step up in one call, so a
model that reads several swapped modules must do so inside
``collection.serving(features)``.

A mode object serves one collection: the collection binds it at construction.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from freescale.comm import Communicator
from freescale.embedding import input_dist
from freescale.embedding.lookup import GroupCall, Timer, stage_ahead
from freescale.embedding.nonfinite import NonFiniteGuard
from freescale.embedding.prioritized import CollisionStats, PrioritizedLookup, PrioritizedSchedule

Features = Mapping[str, Any]


class Lookups(Protocol):
    """What a mode drives: the collection's exchange steps and what running
    them needs (`ShardedEmbeddingCollection` is the one implementation).
    Modes name this, not the collection, so the collection can build its
    mode without the two modules importing each other."""

    comm: Communicator
    overlap_comm: Communicator  # prefetches run here, beside the step's exchanges
    nonfinite: NonFiniteGuard | None
    _anchor: Tensor
    _timer: Timer
    _use_prefetch: bool

    def _start(self, features: Features, comm: Communicator) -> input_dist.PreparedLookup:
        """Begin the input distribution of a lookup of ``features`` on ``comm``."""
        ...

    def _lookup(self, prepared: input_dist.PreparedLookup) -> dict[str, Any]:
        """Finish ``prepared`` synchronously and return its outputs."""
        ...

    def _check_prefetched(self, prepared: input_dist.PreparedLookup, features: Features) -> None:
        """Raise unless ``prepared`` was prefetched for exactly ``features``."""
        ...

    def _split(self, calls: list[GroupCall], outputs: tuple[Tensor, ...]) -> dict[str, Any]:
        """The per-feature outputs of a lookup's per-group ``outputs``."""
        ...


class Mode:
    """The mode interface the collection delegates to; `Sync`'s behaviour."""

    prefetches: ClassVar[bool] = False

    def __init__(self) -> None:
        self._coll: Lookups | None = None

    def bind(self, collection: Lookups) -> None:
        """Called once, by the collection's constructor."""
        if self._coll is not None:
            raise ValueError(f"a {type(self).__name__}() mode serves one collection: make one each")
        self._coll = collection

    @property
    def coll(self) -> Lookups:
        assert self._coll is not None, "the mode is not bound to a collection"
        return self._coll

    def forward(self, features: Features) -> dict[str, Any]:
        """A lookup not answered by `serving`."""
        return self.coll._lookup(self.coll._start(features, self.coll.comm))

    def prefetch(self, features: Features) -> None:
        raise RuntimeError(
            f"prefetch needs a prefetching mode, not {type(self).__name__}: build the "
            "collection with mode=SparseDataDist() or mode=Prioritized()"
        )

    def prefetch_ids(self) -> None:
        """Nothing is prefetched."""

    def prefetch_waits_for_gpu(self) -> bool:
        return False

    def flush(self) -> None:
        """No update is deferred."""

    def collision_stats(self) -> CollisionStats | None:
        return None

    def check_load(self) -> None:
        """Raise if loading tables now would leave prefetched rows stale."""

    def lookahead_mapped(self) -> bool:
        """Whether a prefetched lookup, not yet run, has had its ids received
        (a dynamic table maps them then: reads and saves look behind it)."""
        return False


class Sync(Mode):
    """Every lookup exchanges its ids when it runs; nothing is prefetched."""


class SparseDataDist(Mode):
    """The input distribution of a later call starts early (TorchRec's sdd)."""

    prefetches = True

    def __init__(self) -> None:
        super().__init__()
        self._pending: deque[input_dist.PreparedLookup] = deque()

    def forward(self, features: Features) -> dict[str, Any]:
        coll = self.coll
        return coll._lookup(self._take(features) or coll._start(features, coll.comm))

    def _take(self, features: Features) -> input_dist.PreparedLookup | None:
        if not self._pending or not self.coll._use_prefetch:
            return None
        prepared = self._pending.popleft()
        self.coll._check_prefetched(prepared, features)
        return prepared

    def prefetch(self, features: Features) -> None:
        self._pending.append(self.coll._start(features, self.coll.overlap_comm))

    def prefetch_ids(self) -> None:
        for prepared in self._pending:
            input_dist.issue_ids(prepared, self.coll.overlap_comm, self.coll._timer)
        if self._pending:  # the next lookup's host-tier rows: gathered from now on
            for call in self._pending[0].calls:
                stage_ahead(call, self.coll._timer)

    def prefetch_waits_for_gpu(self) -> bool:
        return any(p.pending is not None for p in self._pending)

    def lookahead_mapped(self) -> bool:
        return any(c.recv_slots is not None for p in self._pending for c in p.calls)


class Prioritized(Mode):
    """Prioritized updates: only the collision rows of the next step wait."""

    prefetches = True

    def __init__(self) -> None:
        super().__init__()
        self.schedule: PrioritizedSchedule | None = None

    def bind(self, collection: Lookups) -> None:
        super().bind(collection)
        self.schedule = PrioritizedSchedule(
            collection.comm, collection._timer, collection.overlap_comm
        )

    @property
    def _prio(self) -> PrioritizedSchedule:
        assert self.schedule is not None, "the mode is not bound to a collection"
        return self.schedule

    def forward(self, features: Features) -> dict[str, Any]:
        coll, prio = self.coll, self._prio
        training = torch.is_grad_enabled() and coll._use_prefetch
        if not prio.steps and training:
            prio.complete_pending()  # this forward's own lookup, half prefetched
        if not training:
            # An evaluation lookup: it reads the current tables and updates
            # nothing, so prefetched rows stay valid.
            prio.flush()
            if torch.is_grad_enabled() and prio.steps:
                raise RuntimeError(
                    "a lookup with gradients outside the prioritized schedule would change "
                    "rows already prefetched: run it under torch.no_grad()"
                )
            return coll._lookup(coll._start(features, coll.comm))
        state = prio.take()
        if state is None:
            state = prio.prefetch(coll._start(features, coll.overlap_comm))
        else:
            coll._check_prefetched(state.prepared, features)
        if not state.prepared.calls:  # no rank passed features: nothing to update
            prio.discard(state)
            return {}
        outputs = PrioritizedLookup.apply(coll._anchor, prio, state, coll.nonfinite)
        return coll._split(state.prepared.calls, outputs)

    def prefetch(self, features: Features) -> None:
        prio = self._prio
        prio.complete_pending()  # an earlier step's, not completed yet
        prio.check_can_prefetch()  # before any collective is issued
        prio.pending = self.coll._start(features, self.coll.overlap_comm)

    def prefetch_ids(self) -> None:
        self._prio.complete_pending()

    def prefetch_waits_for_gpu(self) -> bool:
        pending = self._prio.pending
        return pending is not None and pending.pending is not None

    def flush(self) -> None:
        self._prio.flush()

    def collision_stats(self) -> CollisionStats | None:
        self._prio.complete_pending()  # the split of a half-done prefetch
        return self._prio.last_stats

    def lookahead_mapped(self) -> bool:
        return any(not s.forwarded for s in self._prio.steps)

    def check_load(self) -> None:
        if self._prio.steps:
            raise RuntimeError("load a checkpoint with no prioritized step prefetched")


# The trainer's mode names (`TrainConfig.mode`).
MODES: dict[str, type[Mode]] = {"sync": Sync, "sdd": SparseDataDist, "freescale": Prioritized}
