"""`LoadBalancer`: the paper's Algorithm 1 over a `Communicator`, in three stages.

- Stage I (`start_stage1`): all-gather, on ``meta_comm``, one int64 row per
  rank: [B_r, C_r (candidates), schema fingerprint, B_r UIH lengths, B_r
  candidate counts], the length lists padded to a capacity every rank shares.
  The capacity starts at ``BalancerConfig.capacity`` and grows to the largest
  local batch seen: if a rank's batch did not fit, every rank sees it after
  the wait and all re-gather once with the larger capacity (so uneven and
  changing local batch sizes work; only the first oversized step pays a
  second round trip).
- Stage II (`stage2`): wait for stage I, then all-gather the composite
  candidate lengths (content length of every candidate), padded to the
  largest per-rank candidate count, which stage I made known.
- Planning (`plan_step`): wait for stage II, run the partitioner on the host
  (every rank gets the same plan), check it and derive this rank's `Routing`.
  Host-only, so `gather` does it too and a helper thread hides all of it.
- Stage III (`start_stage3` + `finish`, or `stage3` for both): plan if not
  done yet, then issue one AllToAll per sample tensor (`start_exchange`);
  `finish` waits and returns the balanced batch.

Each call issues its collectives asynchronously and waits only for the
previous stage's, so the pipeline can put the stages at different hook points
of the current step and hide them behind its compute. Several steps may be
in flight at once, provided every rank makes the same calls in the same order
(collectives pair up by issue order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from freescale.balance.cost import CostModel, CostModelConfig
from freescale.balance.exchange import PendingExchange, schema_fingerprint, start_exchange
from freescale.balance.plan import Plan, check_plan
from freescale.balance.planner import ProcessPlanner, plan_in_thread
from freescale.balance.registry import resolve_partitioner
from freescale.balance.routing import Routing, route
from freescale.balance.runtime import Partitioner, RuntimeInfo
from freescale.balance.vbs import AutoTune, AutoTuneConfig
from freescale.balance.world import NUM_FEATURES, WorldLengths, sample_features
from freescale.comm import Communicator, Work
from freescale.jagged import SampleBatch
from freescale.naming import python_name

_HEADER = 3  # B_r, C_r, schema fingerprint


@dataclass
class BalancerConfig:
    """``partitioner``: "none" | "fbs" | "vbs" | "cost" | a registered name | a
    callable; ``capacity``: initial stage-I per-rank sample capacity (0 = learn
    it on the first step at the price of one extra round); ``verify_plans``:
    all-gather a plan digest in stage III and raise if ranks disagree (costs a
    blocking meta round trip; for tests and debugging); ``plan_in_process``:
    run the partitioner in a helper process (`freescale.balance.planner`), so
    its Python loops never hold the caller's GIL."""

    partitioner: str | Partitioner = "fbs"
    capacity: int = 0
    verify_plans: bool = False
    plan_in_process: bool = False
    autotune: AutoTuneConfig = field(default_factory=AutoTuneConfig)
    cost_model: CostModelConfig = field(default_factory=CostModelConfig)

    def __post_init__(self) -> None:
        if self.capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {self.capacity}")
        resolve_partitioner(self.partitioner)  # unknown names fail here


class BalanceHandle:
    """One global step moving through the stages. After stage III starts,
    ``world`` and ``plan`` describe the step (for metrics and `observe`)."""

    def __init__(self, step: int, batch: SampleBatch, local: WorldLengths, cap: int) -> None:
        self.step = step
        self.batch: SampleBatch | None = batch
        self.local = local
        self.capacity = cap
        self.fingerprint = schema_fingerprint(batch)
        self.stage = 1
        self.world: WorldLengths | None = None
        self.plan: Plan | None = None
        self._work: Work | None = None
        self._pending: PendingExchange | None = None
        self._uih: Tensor | None = None
        self._ncand: Tensor | None = None
        self._ncand_rank: list[int] = []
        self._sizes: list[int] = []
        self._routing: Routing | None = None

    @property
    def total_candidates(self) -> int:
        """Global candidate count of the step (the loss normalizer), after stage II."""
        if self.stage < 2:
            raise RuntimeError("total_candidates is known after stage2")
        return sum(self._ncand_rank)

    def rank_features(self) -> Tensor:
        """``[W, 5]``: summed cost features of every rank's balanced batch."""
        if self.world is None or self.plan is None:
            raise RuntimeError("rank_features needs stage III to have started")
        feats = torch.zeros(self.world.world_size, NUM_FEATURES, dtype=torch.float64)
        return feats.index_add_(0, self.plan.dest(), sample_features(self.world))

    def _expect(self, stage: int, what: str) -> None:
        if self.stage != stage:
            raise RuntimeError(f"{what} needs a handle after stage {stage - 1}, got {self.stage}")


class LoadBalancer:
    """Balances one global step at a time (samples never cross steps).

    ``comm`` moves the samples (stage III); ``meta_comm`` (default: ``comm``)
    gathers the lengths (stages I–II) and should be a host (gloo) group when
    ``comm`` is NCCL, since the lengths live on the host and the partitioner
    reads them there.
    """

    def __init__(
        self,
        comm: Communicator,
        config: BalancerConfig | None = None,
        meta_comm: Communicator | None = None,
    ) -> None:
        self.comm = comm
        self.meta = meta_comm if meta_comm is not None else comm
        if (self.meta.rank, self.meta.world_size) != (comm.rank, comm.world_size):
            raise ValueError("meta_comm must have the same rank and world size as comm")
        self.config = config or BalancerConfig()
        self.partitioner = resolve_partitioner(self.config.partitioner)
        self.planner = (
            ProcessPlanner(self.partitioner) if self.config.plan_in_process else plan_in_thread
        )
        self.autotune = AutoTune(comm.world_size, self.config.autotune)
        self.cost_model = CostModel(self.config.cost_model)
        self.last_times_ms: tuple[float, ...] | None = None
        self._capacity = self.config.capacity
        self._started = 0

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    # ---- stage I -------------------------------------------------------------
    def start_stage1(
        self, batch: SampleBatch, lengths: WorldLengths | None = None
    ) -> BalanceHandle:
        """Issue the gather of this rank's UIH lengths and candidate counts.

        ``lengths``: the batch's sizes as a one-rank `WorldLengths` when the
        caller has them on the host already (otherwise read from ``batch``,
        a device-to-host copy if it lives on a GPU).
        """
        local = lengths if lengths is not None else WorldLengths.from_batches([batch])
        if local.world_size != 1 or local.total != batch.batch_size:
            raise ValueError("lengths must be the one-rank WorldLengths of this batch")
        h = BalanceHandle(self._started, batch, local, self._capacity)
        self._started += 1
        h._work = self.meta.all_gather(self._stage1_row(h).to(self.meta.device))
        return h

    def _stage1_row(self, h: BalanceHandle) -> Tensor:
        cap, b = h.capacity, h.local.total
        row = torch.zeros(_HEADER + 2 * cap, dtype=torch.int64)
        row[0], row[1], row[2] = b, h.local.total_candidates, h.fingerprint
        n = min(b, cap)
        row[_HEADER : _HEADER + n] = h.local.uih_lengths[:n]
        row[_HEADER + cap : _HEADER + cap + n] = h.local.num_candidates[:n]
        return row

    # ---- stage II ------------------------------------------------------------
    def stage2(self, h: BalanceHandle) -> BalanceHandle:
        """Wait for stage I; issue the gather of the composite candidate lengths."""
        h._expect(1, "stage2")
        rows = self._wait_rows(h)
        if len(set(rows[:, 2].tolist())) != 1:
            raise ValueError(
                "ranks hold batches with different features, dtypes or dense parts"
                f" (schema fingerprints {rows[:, 2].tolist()})"
            )
        sizes = rows[:, 0].tolist()
        if max(sizes) > h.capacity:  # someone did not fit: all re-gather, once
            self._capacity = max(self._capacity, max(sizes))
            h.capacity = self._capacity
            h._work = self.meta.all_gather(self._stage1_row(h).to(self.meta.device))
            rows = self._wait_rows(h)
        cap = h.capacity
        h._sizes = sizes
        h._uih = torch.cat([rows[r, _HEADER : _HEADER + b] for r, b in enumerate(sizes)])
        h._ncand = torch.cat(
            [rows[r, _HEADER + cap : _HEADER + cap + b] for r, b in enumerate(sizes)]
        )
        h._ncand_rank = rows[:, 1].tolist()
        width = max(h._ncand_rank)
        h._work = None
        if width:  # every rank knows width; all skip together when there are no candidates
            row = torch.zeros(width, dtype=torch.int64)
            row[: h.local.total_candidates] = h.local.candidate_lengths
            h._work = self.meta.all_gather(row.to(self.meta.device))
        h.stage = 2
        return h

    def _wait_rows(self, h: BalanceHandle) -> Tensor:
        assert h._work is not None
        return h._work.wait().cpu().view(self.world_size, _HEADER + 2 * h.capacity)

    def gather(self, batch: SampleBatch, lengths: WorldLengths | None = None) -> BalanceHandle:
        """Stages I and II and the planning, back to back (host only, blocking).

        Meant for a helper thread: it uses only ``meta_comm``, so with a
        ``meta_comm`` group of its own it runs concurrently with the training
        collectives, and `start_stage3` then only issues the sample AllToAlls.
        The plan uses the runtime information (`observe`) present when this
        is called; the caller must not call `observe` until it returns.
        """
        return self.plan_step(self.stage2(self.start_stage1(batch, lengths)))

    # ---- stage III -----------------------------------------------------------
    def plan_step(self, h: BalanceHandle) -> BalanceHandle:
        """Wait for stage II, partition, check the plan and route (host only)."""
        h._expect(2, "plan_step")
        if h._routing is not None:
            return h
        counts = h._ncand_rank
        if h._work is not None:
            rows = h._work.wait().cpu().view(self.world_size, max(counts))
            cand = torch.cat([rows[r, :c] for r, c in enumerate(counts)])
        else:
            cand = torch.zeros(0, dtype=torch.int64)
        assert h._uih is not None and h._ncand is not None
        h.world = WorldLengths(tuple(h._sizes), h._uih, h._ncand, cand)
        h.plan = self._partition(h.world, h.step)
        h._routing = route(h.world, h.plan, self.comm.rank)
        h._work = None
        return h

    def start_stage3(self, h: BalanceHandle) -> BalanceHandle:
        """Plan (unless `gather` did) and issue the AllToAlls of the samples."""
        self.plan_step(h)
        assert h.batch is not None and h._routing is not None
        h._pending = start_exchange(self.comm, h.batch, h._routing)
        h.batch, h._routing = None, None  # the exchange holds what it still needs
        h.stage = 3
        return h

    def _partition(self, world: WorldLengths, step: int) -> Plan:
        plan = self.planner(self.partitioner, world, self.runtime_info(step))
        try:
            check_plan(plan, world.world_size, world.total)
        except ValueError as e:  # every rank computed the same plan: all stop here, alike
            spec = self.config.partitioner
            name = spec if isinstance(spec, str) else python_name(spec)
            raise ValueError(f"step {step}: partitioner {name!r} returned a bad plan: {e}") from e
        if self.config.verify_plans:
            digest = torch.tensor([plan.digest()], dtype=torch.int64, device=self.meta.device)
            digests = self.meta.all_gather(digest).wait().cpu().tolist()
            if len(set(digests)) != 1:
                raise RuntimeError(f"ranks computed different plans (digests {digests})")
        return plan

    def finish(self, h: BalanceHandle, stream: torch.Stream | None = None) -> SampleBatch:
        """Wait for stage III; the balanced batch (on ``comm.device``, plan order)."""
        h._expect(3, "finish")
        assert h._pending is not None
        out = h._pending.wait(stream)
        h._pending = None
        h.stage = 4
        return out

    def stage3(self, h: BalanceHandle, stream: torch.Stream | None = None) -> SampleBatch:
        """`start_stage3` then `finish`."""
        return self.finish(self.start_stage3(h), stream)

    def balance(self, batch: SampleBatch) -> SampleBatch:
        """All three stages back to back (no overlap)."""
        return self.stage3(self.stage2(self.start_stage1(batch)))

    # ---- runtime information ------------------------------------------------
    def runtime_info(self, step: int) -> RuntimeInfo:
        return RuntimeInfo(
            step=step,
            rank_times_ms=self.last_times_ms,
            shares=self.autotune.shares,
            cost_model=self.cost_model,
        )

    def observe(
        self,
        step_compute_ms_per_rank: Sequence[float],
        per_rank_batch_features: Tensor | None = None,
    ) -> None:
        """Feed one step's measured per-rank compute times (all ranks, identical
        values on every rank) to AutoTune, and with the ``[W, 5]`` features of
        the batches those times were measured on (`BalanceHandle.rank_features`)
        to the cost model."""
        times = tuple(float(t) for t in step_compute_ms_per_rank)
        if len(times) != self.world_size:
            raise ValueError(f"need {self.world_size} rank times, got {len(times)}")
        if per_rank_batch_features is not None:  # validates both before anything changes
            self.cost_model.observe(per_rank_batch_features, times)
        self.autotune.update(times)
        self.last_times_ms = times

    def state_dict(self) -> dict[str, Any]:
        """What later plans depend on (checkpoints): cost model, AutoTune, last times."""
        return {
            "cost_model": self.cost_model.state_dict(),
            "autotune": self.autotune.state_dict(),
            "last_times_ms": self.last_times_ms,
            "capacity": self._capacity,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict`. One saved at another world size (a resumed run
        with more or fewer ranks) keeps the cost model, whose rows are per-rank
        observations valid at any world size, and the capacity; AutoTune's
        per-rank shares and the last per-rank times start afresh."""
        self.cost_model.load_state_dict(state["cost_model"])
        self._capacity = max(self._capacity, int(state["capacity"]))
        if len(state["autotune"]["shares"]) == self.world_size:
            self.autotune.load_state_dict(state["autotune"])
            self.last_times_ms = state["last_times_ms"]

    def start_at(self, step: int) -> None:
        """The next `start_stage1` is global step ``step`` (a resumed run)."""
        self._started = step

    def close(self) -> None:
        """Stop the planning process, if any."""
        if isinstance(self.planner, ProcessPlanner):
            self.planner.close()
