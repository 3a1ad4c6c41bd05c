"""`ShardedEmbeddingCollection`: row-wise sharded tables behind one module.

``forward({feature: ids})`` returns ``{feature: embeddings}`` aligned with the
input: a `JaggedTensor` of ids gives a `JaggedTensor` of ``[N, D]`` values
with the same offsets; a plain integer tensor of any shape gives
``ids.shape + (D,)`` (the ``nn.Embedding`` contract). Every rank must call it
with the same feature keys, in the same order of calls, and backpropagate
through every call (as with DDP); the number of ids per rank is free,
zero included. The optimizer update happens inside backward.

Gradient scaling is explicit: the update uses exactly d(loss)/d(embedding)
as autograd delivers it. Nothing is divided by the world size. Normalize the
loss by the *global* number of samples (or candidates) of the step, see
`freescale.embedding.scaling`, and the update does not depend on how the
samples were split across ranks.

The mode, fixed at construction (`freescale.embedding.modes`), decides what
``prefetch`` does and when exchanges run: `Sync` (the default), `SparseDataDist`
or `Prioritized` (paper Algorithm 2: ``prefetch(features)`` of step i+1 looks
up every row step i does not update; only the collision rows wait). Results
are bit-identical in every mode; ``flush()`` applies a deferred part of the
last update (the checkpoint and full-table reads call it).

One lookup per step (`serving`): a model may call several swapped modules
(an item table, a category table, a TorchRec collection) separately. The
trainer looks every one of them up in one call, ``with serving(features):``,
and each module's call inside is answered from that call's outputs: every
table of a step travels in one exchange, which a prefetching mode (one
lookup per step) needs. Its swapped modules refuse a training call outside
`serving` (`lookup_needs_serving`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from freescale.comm import Communicator
from freescale.embedding import input_dist
from freescale.embedding.config import ShardingPlan, TableConfig
from freescale.embedding.dynamic.shard import counts_of, gather_by_id
from freescale.embedding.dynamic.spec import table_seed
from freescale.embedding.host_tier import check_host_memory, ranks_on_host
from freescale.embedding.layout import check_names, group_tables, host_tier_bytes, row_sharding
from freescale.embedding.lookup import GroupCall, ShardedLookup, Timer, no_timer
from freescale.embedding.modes import Mode, Sync
from freescale.embedding.nonfinite import NonFiniteGuard
from freescale.embedding.preflight import Request, make_request
from freescale.embedding.prioritized import CollisionStats
from freescale.embedding.store import ShardStore
from freescale.jagged import JaggedTensor
from freescale.jagged.interop import embeddings_to_torchrec, is_kjt, kjt_to_features

Features = Mapping[str, JaggedTensor | Tensor]
Outputs = dict[str, JaggedTensor | Tensor]


class ShardedEmbeddingCollection(nn.Module):
    """Several tables, grouped by (dtype, dim, optimizer, placement), sharded row-wise
    over ``comm``. Host-placed tables keep their shards in host memory
    (`freescale.embedding.host_tier`); this rank's share must fit (checked first).

    Keyword-only, fixed for the collection's life: ``mode`` (`Sync()` if not
    given; `freescale.embedding.modes`); ``timer(section)``, a context manager
    around each exchange and update (`freescale.embedding.lookup.Timer`);
    ``overlap_comm``, which carries the exchanges issued ahead of their use
    (the next step's preflight, ids, collision marks and rows, deferred
    gradients; e.g. the SM-free backend) while the blocking ones stay on
    ``comm``; ``inputs_checked``: the caller checked every id and offset on
    the host (the trainer's loader does), so the device check is skipped and
    at world size 1 the forward no longer waits for the GPU (counts are the
    ids' sizes). Lookups under `prefetch_disabled` (evaluation) are checked
    anyway.
    """

    def __init__(
        self,
        tables: Sequence[TableConfig],
        comm: Communicator,
        plan: ShardingPlan | None = None,
        device: torch.device | str | None = None,
        seed: int = 0,
        *,
        mode: Mode | None = None,
        timer: Timer = no_timer,
        overlap_comm: Communicator | None = None,
        inputs_checked: bool = False,
    ) -> None:
        super().__init__()
        plan = plan if plan is not None else ShardingPlan()
        check_names(tables)
        overlap_comm = overlap_comm if overlap_comm is not None else comm
        if (overlap_comm.rank, overlap_comm.world_size) != (comm.rank, comm.world_size):
            raise ValueError("the overlap communicator must span the same ranks")
        self.comm, self.plan, self.overlap_comm = comm, plan, overlap_comm
        self._timer, self._inputs_checked = timer, inputs_checked
        self.device = torch.device(device) if device is not None else comm.device
        tables = [dataclasses.replace(t, dynamic=plan.dynamic_for(t)) for t in tables]
        self.tables = {t.name: t for t in tables}
        self.stores = nn.ModuleList()
        self._where: dict[str, tuple[int, int]] = {}
        grouped = group_tables(tables, plan)
        check_host_memory(host_tier_bytes(grouped, comm.world_size), ranks_on_host(comm.world_size))
        for g, (opt, placement, members) in enumerate(grouped):
            shardings = [row_sharding(t, comm.world_size, plan) for t in members]
            # a dynamic table's rows start from (table seed, id): not from its group
            own = table_seed(seed, members[0].name) if members[0].dynamic else seed + g
            store = ShardStore(members, shardings, opt, comm.rank, self.device, own, placement)
            self.stores.append(store)
            self._where.update({t.name: (g, i) for i, t in enumerate(members)})
        self._feature_table = {f: t.name for t in tables for f in t.features}
        # Autograd anchor: makes every lookup output part of the graph so that
        # backward (and with it the fused update) runs. Not a parameter, so
        # dense optimizers and DDP never see it.
        self._anchor = torch.empty(0, requires_grad=True)
        self._use_prefetch = True
        # Compare prefetched ids with the forward's ids (exact; a host sync on GPU).
        self.verify_prefetch = self.device.type == "cpu"
        self.nonfinite: NonFiniteGuard | None = None  # see `guard_nonfinite`
        # Swapped modules put the tables in their model's state_dict (a collective).
        self.tables_in_state_dict = True
        # `serving`: {feature: (its ids as requested, its output)} not yet taken.
        self._served: dict[str, tuple[JaggedTensor | Tensor, JaggedTensor | Tensor]] | None = None
        self.mode = mode if mode is not None else Sync()
        self.mode.bind(self)

    # ---- lookup --------------------------------------------------------------
    def forward(self, features: Features) -> Outputs:
        """Look up every feature; see the module docstring for the contract.

        A TorchRec ``KeyedJaggedTensor`` is accepted too and gives TorchRec's
        ``{feature: JaggedTensor}`` (`freescale.jagged.interop`)."""
        if is_kjt(features):
            ours = kjt_to_features(features)  # type: ignore[arg-type]
            return embeddings_to_torchrec(self(ours), ours)
        if self._served is not None:
            return self._serve(features)
        return self.mode.forward(features)

    def _lookup(self, prepared: input_dist.PreparedLookup) -> Outputs:
        """The synchronous lookup of ``prepared`` (its ids exchange issued if not yet)."""
        input_dist.issue_ids(prepared, self.comm, self._timer)
        if not prepared.calls:  # every rank passed no features (the preflight checked that)
            return {}
        outputs = ShardedLookup.apply(
            self._anchor, prepared.calls, self.comm, self._timer, self.nonfinite
        )
        return self._split(prepared.calls, outputs)

    # ---- one lookup per step for every module ----------------------------------
    @contextlib.contextmanager
    def serving(self, features: Features) -> Iterator[Outputs]:
        """Look ``features`` up in one call; inside, lookups of any subset of
        them (e.g. by swapped modules, each with its own features) return
        those outputs instead of exchanging again. Each feature is served
        once; one that is never asked for is an error on leaving (its rows
        would get no gradient, and a prefetch would go unmatched)."""
        if self._served is not None:
            raise RuntimeError("serving() calls do not nest")
        outputs = self(features)
        self._served = {k: (features[k], v) for k, v in outputs.items()}
        failed = False
        try:
            yield outputs
        except BaseException:
            failed = True
            raise
        finally:
            left, self._served = self._served, None
            if left and not failed:
                raise RuntimeError(
                    f"features {sorted(left)} were looked up for this step but never used: "
                    "embedding_inputs must name exactly the lookups forward makes"
                )

    def lookup_needs_serving(self) -> bool:
        """Whether a training lookup of part of a step's features, now, would
        break the mode's one lookup per step (a prefetching mode, outside
        `serving`, gradients on, prefetch not disabled)."""
        return (
            self.mode.prefetches
            and self._served is None
            and self._use_prefetch
            and torch.is_grad_enabled()
        )

    def _serve(self, features: Features) -> Outputs:
        assert self._served is not None
        out: Outputs = {}
        for key, ids in features.items():
            if key not in self._served:
                raise RuntimeError(
                    f"lookup of {key!r} during a step was not given to serving() or is made "
                    "twice: embedding_inputs must name every lookup forward makes, once"
                )
            want, emb = self._served.pop(key)
            if not _same_ids(want, ids, exact=self.verify_prefetch):
                raise RuntimeError(
                    f"lookup of {key!r} during a step does not match the ids given for it "
                    "(embedding_inputs must return exactly the ids forward looks up)"
                )
            out[key] = emb
        return out

    # ---- prefetching modes: start a future call's input distribution early ----
    def prefetch(self, features: Features) -> None:
        """Start the input distribution of a *later* ``forward(features)``.

        Needs a prefetching mode (`SparseDataDist`, `Prioritized`). Issues the
        validation/counts exchange now; `prefetch_ids` (or the forward itself)
        then issues the ids AllToAll. Calls are matched in order; every rank
        must prefetch the same calls.

        In `Prioritized` mode the work of the next step that waits for no
        update runs in two phases: this call issues its preflight exchange;
        `prefetch_ids` (or, at the latest, the next ``prefetch`` or the
        forward that needs it) does the rest. Call it for
        step i+1 before step i's backward, at most one step ahead; calling
        `prefetch_ids` after step i's forward has been launched keeps the
        host's one read of the counts off the GPU's critical path.
        """
        if is_kjt(features):
            features = kjt_to_features(features)  # type: ignore[arg-type]
        self.mode.prefetch(features)

    def prefetch_ids(self) -> None:
        """Read the counts of every prefetched call and issue its ids AllToAll
        (`Prioritized`: complete the prefetch of the next step)."""
        self.mode.prefetch_ids()

    def prefetch_waits_for_gpu(self) -> bool:
        """Whether `prefetch_ids` now would wait for the GPU: some prefetched
        lookup still has its counts to read. If not (one rank with
        ``inputs_checked``), calling it at once costs the host nothing."""
        return self.mode.prefetch_waits_for_gpu()

    @contextlib.contextmanager
    def prefetch_disabled(self) -> Iterator[None]:
        """Lookups inside (e.g. evaluation) run in place, leave prefetched ones
        alone and check their input on the device (``inputs_checked`` is
        about the caller's own batches)."""
        self._use_prefetch, saved = False, self._use_prefetch
        try:
            yield
        finally:
            self._use_prefetch = saved

    def _start(self, features: Features, comm: Communicator) -> input_dist.PreparedLookup:
        keys = sorted(features)
        unknown = [k for k in keys if k not in self._feature_table]
        requests = [] if unknown else [self._request(k, features[k]) for k in keys]
        checked = self._inputs_checked and self._use_prefetch
        learns = self._use_prefetch and torch.is_grad_enabled()
        # a read between steps sees the tables as a synchronous run has them
        behind = not learns and self.mode.lookahead_mapped()
        return input_dist.start(
            comm, list(self.stores), keys, requests, unknown, self.device, checked, learns, behind
        )

    def _check_prefetched(self, prepared: input_dist.PreparedLookup, features: Features) -> None:
        keys = sorted(features)
        requests = [self._request(k, features[k]) for k in keys if k in self._feature_table]
        sizes = input_dist.request_sizes(requests)
        if not prepared.matches(keys, sizes) or (
            self.verify_prefetch and not prepared.same_ids(requests)
        ):
            raise RuntimeError(
                "a prefetched lookup does not match this call (keys "
                f"{prepared.keys} vs {keys}): prefetch exactly the ids forward will use"
            )

    @contextlib.contextmanager
    def tables_left_out(self) -> Iterator[None]:
        """Inside, a swapped model's ``state_dict()`` / ``load_state_dict()`` hold
        only its dense part: no table, no collective (what one rank may save
        alone; the tables go to the checkpoint through the collection itself)."""
        self.tables_in_state_dict, saved = False, self.tables_in_state_dict
        try:
            yield
        finally:
            self.tables_in_state_dict = saved

    # ---- non-finite guard --------------------------------------------------------
    def guard_nonfinite(self, enabled: bool = True) -> NonFiniteGuard | None:
        """Skip, on every rank, an update whose gradients (or the evidence given
        to ``nonfinite.begin_step``, e.g. the loss) are not finite on any rank.

        Costs one small all-gather per backward and no host read; set it on
        every rank alike, between steps. Returns the guard (None when disabled).
        """
        self.nonfinite = NonFiniteGuard(self.comm) if enabled else None
        return self.nonfinite

    # ---- what the mode defers ---------------------------------------------------
    def flush(self) -> None:
        """Apply the deferred (exclusive) part of the last update; local, no collective."""
        self.mode.flush()

    def host_tier_traffic(self) -> Tensor | None:
        """Bytes this rank's host-tier tables moved between host and device since
        the last call ([1] int64 on the device, not read here); None without any."""
        tiers = [s.tier for s in self.stores if s.tier is not None]  # type: ignore[union-attr]
        if not tiers:
            return None
        return torch.stack([t.take_bytes() for t in tiers]).sum().reshape(1).double()

    def dynamic_counts(self) -> tuple[int, ...] | None:
        """This rank's dynamic tables since the last call (`DynamicStats.take`,
        summed); None without a dynamic table."""
        return counts_of([s.dynamic for s in self.stores if s.dynamic is not None])

    def collision_stats(self) -> CollisionStats | None:
        """Collision of the last prefetched step with the one before, on this rank's shards.

        Device tensors, not read here (reading them would make the host wait
        for the device); None before any collision was computed.
        """
        return self.mode.collision_stats()

    def _request(self, key: str, value: JaggedTensor | Tensor) -> Request:
        table = self.tables[self._feature_table[key]]
        group, slot_table = self._where[table.name]
        if isinstance(value, JaggedTensor):
            return make_request(
                key, table, group, slot_table, value.values, value.offsets, self.device
            )
        return make_request(key, table, group, slot_table, value, None, self.device)

    @staticmethod
    def _split(
        calls: list[GroupCall], outputs: tuple[Tensor, ...]
    ) -> dict[str, JaggedTensor | Tensor]:
        result: dict[str, JaggedTensor | Tensor] = {}
        for call, emb in zip(calls, outputs, strict=True):
            for q, piece in zip(call.requests, emb.split(call.sizes), strict=True):
                if q.offsets is not None:
                    result[q.key] = JaggedTensor(piece, q.offsets)
                else:
                    result[q.key] = piece.reshape(*q.shape, piece.shape[-1])
        return result

    # ---- full-table access (collective on every call that gathers) -----------
    def _locate(self, name: str) -> tuple[ShardStore, int]:
        if name not in self._where:
            raise KeyError(f"unknown table {name!r}")
        g, t = self._where[name]
        return self.stores[g], t  # type: ignore[return-value]

    def _static(self, name: str) -> tuple[ShardStore, int]:
        store, t = self._locate(name)
        if store.dynamic is not None:
            raise ValueError(
                f"table {name!r} is dynamic: its rows are keyed by id (dynamic_rows(name))"
            )
        return store, t

    def dynamic_rows(self, name: str) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """(ids, rows, optimizer state) of dynamic table ``name`` over all ranks,
        by id (a collective)."""
        self.flush()
        store, _ = self._locate(name)
        if store.dynamic is None:
            raise ValueError(f"table {name!r} is static: see full_table(name)")
        return gather_by_id(self.comm, store.dynamic.map, store.weight, store.optimizer_state())

    @torch.no_grad()
    def set_table(self, name: str, weight: Tensor) -> None:
        """Load this rank's rows of table ``name`` from its full ``[rows, dim]`` weight."""
        store, t = self._static(name)
        table = self.tables[name]
        if tuple(weight.shape) != (table.rows, table.dim):
            raise ValueError(
                f"table {name!r}: weight {tuple(weight.shape)} != ({table.rows}, {table.dim})"
            )
        ids = store.local_global_ids(t)
        valid = ids >= 0
        local = store.table_slice(t, store.weight)
        local.zero_()
        # Gather on the source's device: only this rank's rows travel.
        rows = weight.detach()[ids[valid].to(weight.device)]
        local[valid] = rows.to(device=local.device, dtype=local.dtype)

    def full_table(self, name: str) -> Tensor:
        """The whole table ``[rows, dim]``, gathered from all ranks (a collective)."""
        self.flush()
        store, t = self._static(name)
        return self._gather(name, store.full_slice(t, store.weight))

    def full_optimizer_state(self, name: str) -> dict[str, Tensor]:
        """The optimizer state of table ``name`` over all rows (a collective per tensor)."""
        self.flush()
        store, t = self._static(name)
        return {
            k: self._gather(name, store.full_slice(t, v))
            for k, v in store.optimizer_state().items()
        }

    def step_of(self, name: str) -> int:
        """Number of updates table ``name`` has received."""
        store, t = self._locate(name)
        store.settle()
        return int(store.steps[t])

    # ---- checkpoints see current tables ----------------------------------------
    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        if self.mode.lookahead_mapped() and any(s.dynamic for s in self.stores):
            raise ValueError(
                "a dynamic table saved by rank as it lies would hold the next step, mapped "
                "ahead: save between steps with nothing prefetched, or save TableEntries"
            )
        self.flush()  # runs before the stores write their tensors
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: Any) -> None:
        self.mode.check_load()
        self.flush()  # complete the pending exchange; the load overwrites its rows
        super()._load_from_state_dict(state_dict, prefix, *args)

    def _gather(self, name: str, local: Tensor) -> Tensor:
        store, t = self._locate(name)
        gathered = self.comm.all_gather(local.detach().contiguous()).wait()
        w = self.comm.world_size
        ids = torch.cat([store.shardings[t].global_ids(r, gathered.device) for r in range(w)])
        valid = ids >= 0
        out = gathered.new_empty((self.tables[name].rows, *gathered.shape[1:]))
        out[ids[valid]] = gathered[valid]
        return out


def _same_ids(a: JaggedTensor | Tensor, b: JaggedTensor | Tensor, exact: bool) -> bool:
    """Same shape (and, where reading the device is free, same values)."""
    if a is b:
        return True
    if isinstance(a, JaggedTensor) != isinstance(b, JaggedTensor):
        return False
    pairs = (
        [(a.values, b.values), (a.offsets, b.offsets)] if isinstance(a, JaggedTensor) else [(a, b)]
    )  # type: ignore[union-attr]
    return all(x.shape == y.shape and (not exact or torch.equal(x, y)) for x, y in pairs)
