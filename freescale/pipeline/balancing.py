"""The load balancer as pipeline stages, working two steps ahead.

Step s trains on balanced batch s while the raw batch of step s+2 goes
through the balancer: stages I-II (gather lengths and candidate sizes over a
gloo group), the partitioner and this rank's balanced sizes (its `BatchInfo`,
FLOPs included) run on a helper thread from the start of the step, stage III
(the sample AllToAll) is issued after forward, while the host is still ahead
of the GPU, and collected at the end of the step. Two
steps ahead, because ``sdd`` must know balanced batch s+1 when step s starts
(to prefetch its ids).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from freescale.balance import (
    BalanceHandle,
    BalancerConfig,
    CostPartitioner,
    LoadBalancer,
    WorldLengths,
    sample_features,
)
from freescale.comm import TorchCommunicator
from freescale.jagged.batch import SampleBatch
from freescale.observe.flops import count, model_flops, sized_batch
from freescale.pipeline.liveness import gloo_group
from freescale.pipeline.loader import BatchInfo

LOOKAHEAD = 2


def balance_partitioner(section: Any, batch_size: int) -> str | CostPartitioner:
    """The partitioner the ``balance`` section asks for (``method`` + ``counts``)."""
    if section.method == "cost" and section.counts == "variable":
        return CostPartitioner("variable", section.max_local_batch or 2 * batch_size)
    return section.method


def balance_stage(
    section: Any, run: Any, comm: TorchCommunicator, timer: Any, device: Any, model: Any = None
) -> BalanceStage | None:
    """The ``balance`` section's stage (None for ``method=none``); ``run``: the
    run section (batch size, determinism, timeout); ``model``: whose ``flops(batch)``
    counts the balanced batches' FLOPs."""
    if section.method == "none":
        return None
    plan = section.plan_process
    in_process = plan == "on" or (plan == "auto" and device.type == "cuda")
    return BalanceStage(
        balance_partitioner(section, run.batch_size), comm, run.batch_size, timer.section,
        in_process, adaptive=not run.deterministic, timeout_s=run.timeout_s,
        flops=model_flops(model),
    )  # fmt: skip


class BalanceStage:
    def __init__(
        self,
        partitioner: str | CostPartitioner,
        comm: TorchCommunicator,
        batch_size: int,
        timer: Any,
        plan_in_process: bool = False,
        adaptive: bool = True,
        timeout_s: float = 300.0,
        flops: Any = None,
    ) -> None:
        # Stages I-II gather host-side lengths on a gloo group of their own, on
        # a helper thread: they never block the trainer's thread and never
        # interleave with the training collectives of the default group.
        meta = TorchCommunicator(group=gloo_group(timeout_s), device="cpu")
        config = BalancerConfig(
            partitioner=partitioner, capacity=batch_size, plan_in_process=plan_in_process
        )
        self.balancer = LoadBalancer(comm, config, meta)
        # Not adaptive (``deterministic = true``): measured times never reach
        # the cost model or AutoTune, so plans depend on the data only.
        self.adaptive = adaptive
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="balancer")
        self.rank = comm.rank
        self.timer, self.flops = timer, flops
        self.gathering: Future[tuple[BalanceHandle, BatchInfo]] | None = None
        self.in_flight: tuple[BalanceHandle, BatchInfo] | None = None
        self.ready: deque[tuple[SampleBatch, BatchInfo, BalanceHandle]] = deque()

    # ---- hook points ---------------------------------------------------------
    def stage1(self, batch: SampleBatch, info: BatchInfo) -> None:
        """Start of step: stages I-II for a raw future batch, on the helper thread."""
        assert self.gathering is None and self.in_flight is None, "one step in flight"
        self.gathering = self.pool.submit(self._plan, batch, info)

    def _plan(self, batch: SampleBatch, info: BatchInfo) -> tuple[BalanceHandle, BatchInfo]:
        """On the helper thread: stages I-II, the plan and this rank's balanced sizes."""
        h = self.balancer.gather(batch, info.lengths)
        return h, self._info(h, batch)

    def stage3(self) -> None:
        """After forward: issue the sample AllToAll (the plan is ready by then)."""
        if self.gathering is None:
            return
        with self.timer("balancer"):  # only what the helper thread has not hidden
            handle, info = self.gathering.result()
            self.gathering = None
            self.in_flight = self.balancer.start_stage3(handle), info

    def collect(self) -> None:
        """End of step: the balanced batch joins the queue."""
        if self.in_flight is None:
            return
        (h, info), self.in_flight = self.in_flight, None
        with self.timer("balancer"):
            batch = self.balancer.finish(h)  # orders the current stream after it
        self.ready.append((batch, info, h))

    def balance_now(self, batch: SampleBatch, info: BatchInfo) -> None:
        """All stages back to back (to fill the pipeline before step 0)."""
        self.stage1(batch, info)
        self.stage3()
        self.collect()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.balancer.close()

    def pop(self) -> tuple[SampleBatch, BatchInfo, BalanceHandle]:
        return self.ready.popleft()

    def observe(self, compute_ms: list[float], handle: BalanceHandle) -> None:
        """Feed measured per-rank compute times back (AutoTune, cost model)."""
        if not self.adaptive:
            return
        # The helper thread plans with the models: never change them under it.
        assert self.gathering is None, "observe while a plan is being made"
        # Timer noise can push a tiny compute time below zero; the models need >= 0.
        self.balancer.observe([max(t, 0.0) for t in compute_ms], handle.rank_features())

    def state_dict(self) -> dict[str, Any]:
        return self.balancer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.balancer.load_state_dict(state)

    def _info(self, h: BalanceHandle, raw: SampleBatch) -> BatchInfo:
        """Host sizes of this rank's balanced batch, from the gathered lengths (its
        FLOPs: the model's count on a batch of those sizes, shaped as ``raw``)."""
        assert h.world is not None and h.plan is not None
        mine = h.plan.samples_of(self.rank)
        uih = h.world.uih_lengths[mine]
        ncand = h.world.num_candidates[mine]
        flops = None
        if self.flops is not None:
            content = h.world.candidate_lengths_of(mine)
            flops = count(self.flops, sized_batch(raw, uih, ncand, content))
        return BatchInfo(
            max_uih=int(uih.max()) if uih.numel() else 0,
            max_candidates=int(ncand.max()) if ncand.numel() else 0,
            uih_tokens=int(uih.sum()),
            candidates=int(ncand.sum()),
            positives=float("nan"),  # labels moved with the samples: read at metrics time
            global_candidates=h.total_candidates,
            samples=int(mine.numel()),
            features=tuple(sample_features(h.world)[mine].sum(dim=0).tolist()),
            flops=flops,
        )


def host_lengths(batch: SampleBatch) -> WorldLengths:
    """This rank's stage-I input, computed in the loader thread on the host."""
    return WorldLengths.from_batches([batch])


class Feed:
    """The trainer's batches: straight from the loader, or through the balancer.

    Every wait for the loader is the timed section ``data``: on CUDA its two
    events are on the compute stream, so it measures how long the *GPU*
    starved for input (zero while the GPU still had queued work), not how
    long the host waited; on CPU ranks it is the host's wall-clock wait.
    """

    def __init__(
        self,
        loader: Any,
        balance: BalanceStage | None,
        steps: int,
        timer: Any,
        first: int = 0,
        check: Any = None,
    ) -> None:
        """Batches of steps ``first`` .. ``steps - 1`` (``first`` > 0: a resumed run);
        ``check(problem, step)`` agrees on input problems before a batch is used."""
        self.loader, self.balance, self.steps, self.timer = loader, balance, steps, timer
        self.check, self.loaded = check, first
        if balance is not None:
            balance.balancer.start_at(first)  # plans see the same step numbers as unresumed
            for _ in range(min(LOOKAHEAD, steps - first)):
                balance.balance_now(*self._load())

    def _load(self) -> tuple[SampleBatch, BatchInfo]:
        with self.timer("data"):
            batch, info = self.loader.get()
        if self.check is not None:
            # A blocking metadata collective: waiting here for a peer (whose
            # loader is late) is exposed communication, as in the count all-reduce.
            with self.timer("meta"):
                self.check(info.problem, self.loaded, info.error)
        self.loaded += 1
        return batch, info

    def take(self) -> tuple[SampleBatch, BatchInfo, BalanceHandle | None]:
        """The next batch to train on."""
        if self.balance is None:
            return (*self._load(), None)
        return self.balance.pop()

    def start_future(self, step: int) -> None:
        """Stage I for the raw batch of step ``step + LOOKAHEAD`` (if any)."""
        if self.balance is not None and step + LOOKAHEAD < self.steps:
            self.balance.stage1(*self._load())
