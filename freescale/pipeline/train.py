"""The staged training loop of one rank: load → forward → backward → optimizer → metrics.

The modes (``sync``, ``sdd``, ``freescale``; all produce identical numbers)
differ only in what they issue early and wait for where: each is one
`freescale.pipeline.schedule` object whose hooks the loop calls. The trainer
keeps the loop; each part (`SparseSide`, `DenseTraining`, `Evaluator`,
`RunState`, ...) is built from its config section, given its inputs then.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from freescale.config import TrainConfig
from freescale.data.source import DataSource, schema_of
from freescale.jagged.batch import SampleBatch
from freescale.models.contract import has_default_loss
from freescale.models.loss import bce_loss_and_sum, bce_total
from freescale.observe.profiling import make_profiler
from freescale.observe.sync_debug import report_host_syncs
from freescale.observe.timing import ONE_RANK_TIMED, SectionTimer
from freescale.pipeline.balancing import Feed, balance_stage, host_lengths
from freescale.pipeline.dense import DenseTraining
from freescale.pipeline.evaluator import Evaluator, best_weights
from freescale.pipeline.faults import Faults
from freescale.pipeline.first_step import FirstStepCheck
from freescale.pipeline.inputs import InputAgreement, Limits, check_all_rows
from freescale.pipeline.liveness import Liveness, gloo_group
from freescale.pipeline.loader import BatchInfo, Prefetcher, default_workers
from freescale.pipeline.recorder import StepMetrics, StepRecord, read_later
from freescale.pipeline.setup import build_model, open_data, pick_device, seed_everything
from freescale.pipeline.sparse import SparseSide, check_host_tier
from freescale.state.run_state import DenseState, RunState


class Trainer:
    """One rank's training run of ``cfg``; ``model`` (an ``nn.Module`` or a
    factory, `freescale.models.contract`) and ``data`` (a `DataSource`)
    replace ``cfg.model`` / ``cfg.data`` when given; ``profiler``: a torch
    profiler (not started) replacing the one ``cfg.output`` asks for."""

    def __init__(
        self, cfg: TrainConfig, model: Any = None, data: DataSource | None = None,
        profiler: Any = None,
    ) -> None:  # fmt: skip
        self.rank, self.world = rank, world = dist.get_rank(), dist.get_world_size()
        self.device = device = pick_device(cfg.run)
        seed_everything(cfg.run)
        cfg, self.source = open_data(cfg, world, data)  # run.epochs: its steps in cfg
        self.cfg, run = cfg, cfg.run
        group = gloo_group(run.timeout_s) if world > 1 else None  # never waits for a GPU
        check_all_rows(self.source, group, rank, world)  # every row, before step 0
        self.schema = schema_of(self.source)
        check_host_tier(cfg, self.schema, model, world)  # before the model takes memory
        with device:  # initialize on the device: large tables init in ms, not minutes
            self.model = build_model(cfg.model, self.schema, model).to(device)
        # one rank exchanges nothing: only its data (and host tier) waits are timed
        self.timer = timer = SectionTimer(device, ONE_RANK_TIMED if world == 1 else None)
        sparse = SparseSide(self.model, cfg.embeddings, cfg.pipeline, run, world, device, timer)
        self.sparse, self.embeddings, self.schedule = sparse, sparse.embeddings, sparse.schedule
        tokens = run.batch_size * cfg.data.max_uih  # the most UIH tokens of a batch
        self.dense = DenseTraining(self.model, cfg.dense, cfg.faults, sparse.guard, device, timer,
                                   tokens, run)  # fmt: skip
        self.optimizer, self.default_loss = self.dense.optimizer, has_default_loss(self.model)
        self.balance = balance_stage(cfg.balance, run, sparse.overlap_comm, timer, device,
                                     self.model)  # fmt: skip
        self.metrics = StepMetrics(cfg.output, rank, run, device, timer, group, self.default_loss)
        self.liveness = Liveness(rank, world, run.timeout_s)
        limits = Limits.of(self.schema, sparse.table_rows)  # the data's sizes, the tables' rows
        self.inputs = InputAgreement(group, rank, world, limits, sparse.host_lookups)
        self.contract = FirstStepCheck(self.model, group, world)  # checks the first step
        best = best_weights(cfg.evaluation, self.model, self.source, self.embeddings)
        self.state = RunState(
            cfg.checkpoint, cfg.as_dict(), group, world, run.batch_size, sparse.table_entries,
            self._replicated(), self.schedule.flush, best, self.source,  # keep_best: checkpointed
        )  # fmt: skip
        self.evaluator = Evaluator(
            cfg.evaluation, self.model, self.source, self.embeddings, self.schedule, rank, world,
            run.batch_size, device, best, self.state.samples_before,
        )  # fmt: skip
        self.faults, self.profiler = Faults(cfg.faults, rank, device), profiler

    @property
    def schedule_name(self) -> str:
        return self.sparse.schedule_name

    @property
    def summary(self) -> Any:  # `RunSummary`: per-step records, evaluations
        return self.metrics.summary

    def _replicated(self) -> dict[str, Any]:
        """What every rank holds alike and a checkpoint saves once (`RunState`)."""
        out = {"model": DenseState(self.model, self.embeddings), "optimizer": self.optimizer}
        return {**out, "balancer": self.balance} if self.balance is not None else out

    def dense_state_dict(self) -> dict[str, Tensor]:
        """The model's state without the sharded tables (no collective)."""
        return DenseState(self.model, self.embeddings).state_dict()

    # ---- one step ----------------------------------------------------------
    def _train_step(
        self, step: int, batch: SampleBatch, info: BatchInfo, features: dict[str, Any]
    ) -> tuple[Tensor, Tensor]:
        """Launch one step: (its [BCE sum(, loss sum)], its flags of `skip_flags`), read later."""
        global_count = self.schedule.global_count(info)
        batch = batch.with_max_lengths(info.max_uih, info.max_candidates)
        with self.embeddings.serving(features):
            logits = self.dense.forward(batch, step)
        self.contract.output(logits, batch)  # the first step's, before loss and backward
        self.faults.delay_compute()
        self.schedule.after_forward()
        if self.balance is not None:
            # Here the host is far ahead of the GPU (forward only launched kernels);
            # after backward it is not: the sparse update reads sizes back.
            self.balance.stage3()
        if self.default_loss:
            loss, total = bce_loss_and_sum(logits, batch.labels, global_count)
        else:  # the model's loss; NE stays that of the logits' BCE
            loss, own = self.contract.loss(self.model.loss(logits, batch, global_count))
            total = torch.stack([bce_total(logits.detach(), batch.labels), own.detach()])
        empty = min(info.samples, info.uih_tokens, info.candidates) == 0
        self.dense.backward(self.faults.loss(step, loss), empty)
        flags = self.dense.step(step)
        if self.balance is not None:
            self.balance.collect()
        return total, flags

    # ---- loop --------------------------------------------------------------
    def run(self) -> dict[str, Any] | None:
        try:
            first, self.train_source = self.state.restore(self.source)
            if self.cfg.eval_only:  # `freescale eval`: the restored model, no training
                final = self.evaluator.final() or {"heldout": self.evaluator.heldout()}
                return {"step": first, "eval": final} if self.rank == 0 else None
            return self._run_from(first)
        finally:
            self.liveness.close()

    def _run_from(self, first: int) -> dict[str, Any] | None:
        run, workers = self.cfg.run, self.cfg.data.loader_workers
        self.metrics.start(first)
        loader = Prefetcher(
            self.train_source, self.rank, self.world, run.batch_size, self.device,
            range(first, run.steps), delay_ms=self.faults.delay_loader_ms, model=self.model,
            host_lengths=host_lengths if self.balance is not None else None,
            workers=workers if workers >= 0 else default_workers(self.device),
            validate=self.inputs.find,
        )  # fmt: skip
        try:
            return self._loop(loader, first)
        finally:
            loader.close()
            if self.balance is not None:
                self.balance.close()

    def _loop(self, loader: Prefetcher, first: int = 0) -> dict[str, Any] | None:
        run, metrics, profiler = self.cfg.run, self.metrics, self.profiler
        if profiler is not None:
            profiler.start()
        else:
            profiler = make_profiler(self.cfg.output, self.rank, self.device)
        start = time.perf_counter()
        feed = Feed(loader, self.balance, run.steps, self.timer.section, first, self.inputs.check)
        nxt = self._take(feed)
        self.timer.take()  # filling the pipeline is no step's time
        pending: StepRecord | None = None
        host_syncs = contextlib.ExitStack()
        step = first - 1
        for step in range(first, run.steps):
            self.liveness.step = step
            if step == run.warmup:
                sync_debug = self.cfg.pipeline.sync_debug
                host_syncs.enter_context(report_host_syncs(sync_debug, self.rank))
            step_start = self.timer.mark()
            batch, info, handle, features = nxt
            feed.start_future(step)  # balancer stage I for step + 2
            if step + 1 < run.steps:
                nxt = self._take(feed)
            bce, flags = self._train_step(step, batch, info, features)
            collision = self.schedule.collision_counts() if step + 1 < run.steps else None
            self.timer.add_interval("step", step_start, self.timer.mark())
            on_device = [bce.reshape(-1), flags]
            if math.isnan(info.positives):  # labels moved with the balanced samples
                on_device.append(batch.labels.sum().double().reshape(1))
            values = torch.cat(on_device).double()  # fp32, bools (and fp64): exact in fp64
            frames = self.dense.step_frames  # dynamo's compiles in the step (dense.compile)
            record = StepRecord(step, info, read_later(values), self.timer.take(), handle, frames,
                                attention_graphs=self.dense.step_graphs)  # fmt: skip
            record.read_later(collision, self.sparse.embeddings)
            if self.evaluator.due(step, run.steps):
                record.eval = {"step": step, **self.evaluator.heldout(step)}
            if pending is not None:
                self._finish(pending, start)
            pending = record
            if profiler is not None:
                profiler.step()
            if metrics.stop_agreed or (self.state.due(step) and not self.evaluator.stop):
                self._finish(pending, start)  # metrics complete up to this step
                pending = None
                self.state.save(step + 1)
            if metrics.stop_agreed or self.evaluator.stop:  # (patience: the same on every rank)
                break
        self.schedule.flush()
        if pending is not None:
            self._finish(pending, start)
        host_syncs.close()
        final = {} if metrics.stop_agreed else self.evaluator.final()  # a stop must be quick
        if profiler is not None:
            profiler.stop()
        metrics.close()
        return self._summary(first, step, start, final) if self.rank == 0 else None

    def _summary(self, first: int, step: int, start: float, final: dict) -> dict[str, Any]:
        extra: dict[str, Any] = {
            "mode": self.cfg.run.mode, "schedule": self.schedule_name,
            "world_size": self.world,
            "device": str(self.device),
            "wall_s": time.perf_counter() - start,
            "first_step": first,
            "nonfinite_skipped": self.dense.nonfinite.skipped,
        }  # fmt: skip
        extra["resumed"] = self.state.resumed() if self.state.data_position else None
        extra.update({**self.dense.graph_summary(), **self.dense.attention_summary()},
                     comm=self.sparse.comm_summary(self.cfg.pipeline))  # fmt: skip
        if final:
            extra["eval"] = final
            if samples := final.get("data", {}).get("train_samples"):  # unknown when streamed
                extra["epochs"] = self.state.samples_before(step + 1) / samples
        if self.metrics.stop_agreed:
            extra.update(stopped="SIGTERM", last_step=step)
        return self.summary.final(extra)

    def _take(self, feed: Feed) -> tuple[SampleBatch, BatchInfo, Any, dict[str, Any]]:
        """The next batch with its lookups, announced to the schedule."""
        batch, info, handle = feed.take()
        features = self.sparse.lookup_features(self.model, batch)
        self.schedule.upcoming(features, info)
        return batch, info, handle, features

    def _finish(self, rec: StepRecord, start: float) -> None:
        observe = self.balance.observe if self.balance is not None else None
        stop = self.liveness.stop_requested
        self.metrics.finish(rec, start, stop, observe, self.dense.nonfinite.count)
