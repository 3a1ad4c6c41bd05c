"""The staged training loop of one rank: load → forward → backward → optimizer → metrics.

The modes (``sync``, ``sdd``, ``freescale``; all produce identical numbers)
differ only in what they issue early and wait for where: each is one
`freescale.pipeline.schedule` object whose hooks the loop calls.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from freescale.comm import make_communicator
from freescale.data.source import DataSource, schema_of
from freescale.embedding import TableEntries, swap
from freescale.embedding.modes import MODES
from freescale.jagged.batch import SampleBatch
from freescale.jagged.ops import copy_to_host, wait_for_copy
from freescale.models.contract import has_default_loss
from freescale.models.loss import bce_loss_and_sum, bce_sum, bce_total, normalized_entropy
from freescale.pipeline.balancing import BalanceStage, Feed, balance_partitioner, host_lengths
from freescale.pipeline.checkpoint import Checkpointer, check_resumable
from freescale.pipeline.config import TrainConfig, trace_window
from freescale.pipeline.evaluation import evaluate_split, popularity_baseline
from freescale.pipeline.export import full_state_dict
from freescale.pipeline.faults import ComputeDelay, applies
from freescale.pipeline.inputs import InputAgreement, Limits, find_problem
from freescale.pipeline.liveness import Liveness, gloo_group, mark_stopped
from freescale.pipeline.loader import BatchInfo, Prefetcher, default_workers
from freescale.pipeline.metrics import (
    NONFINITE,
    STOP,
    JsonLines,
    RankStep,
    RunSummary,
    gather_step,
    summarize_step,
)
from freescale.pipeline.nonfinite import NonFiniteCount, skip_flags
from freescale.pipeline.position import DataPosition, resume_record, resumed_source
from freescale.pipeline.schedule import Schedule
from freescale.pipeline.setup import (
    DenseSync,
    build_model,
    check_data,
    pick_device,
    seed_everything,
    sharding_plan,
)
from freescale.pipeline.sync_debug import report_host_syncs
from freescale.pipeline.timing import COLLISION_PART, SectionTimer, exposed_by_category

EVAL_STEP_OFFSET = 10_000_000  # held-out synthetic samples: far from any training step


def read_later(t: Tensor) -> Callable[[], list[float]]:
    """``t``'s values, copied now without waiting and read when called.

    Reading a device value at once would make the host wait for the GPU at
    the end of every step, leaving the GPU idle while the next step launches.
    """
    host, done = copy_to_host(t)
    return lambda: (wait_for_copy(done, "metrics (one step late)"), host.tolist())[1]


@dataclass
class StepRecord:
    """What one step leaves for its metrics, which are read one step later."""

    step: int
    info: BatchInfo
    # [bce sum (, the model's loss sum)], skip flags (, positives if not in info)
    values: Callable[[], list[float]]
    sections: list
    handle: Any
    eval: dict[str, float] | None = None
    collision: Callable[[], list[float]] | None = None  # freescale: C^i counts, read later


class DenseState:
    """The model's dense part as a ``state_dict`` object: equal on every rank,
    so one rank can save it (the tables are checkpointed by the collection)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.dense_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.trainer.embeddings.tables_left_out():
            self.trainer.model.load_state_dict(state)


class Trainer:
    """One rank's training run of ``cfg``; ``model`` (an ``nn.Module`` or a
    factory, `freescale.models.contract`) and ``data`` (a `DataSource`)
    replace ``cfg.model`` / ``cfg.data`` when given."""

    def __init__(self, cfg: TrainConfig, model: Any = None, data: DataSource | None = None) -> None:
        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = pick_device(cfg)
        seed_everything(cfg)
        self.source = check_data(cfg, self.world, data)
        self.schema = schema_of(self.source)
        # Where training starts in the data (`restore` moves it), and what it reads.
        self.position = DataPosition(world_size=self.world)
        self.train_source, self.data_position = self.source, ""
        with self.device:  # initialize on the device: large tables init in ms, not minutes
            self.model = build_model(cfg, self.schema, model).to(self.device)
        # One rank exchanges nothing: its communication sections would time
        # identities. Only the data wait is read from the sections there.
        self.timer = SectionTimer(self.device, frozenset({"data"}) if self.world == 1 else None)
        self.comm = make_communicator(cfg.comm_backend, self.device)
        self.overlap_comm = self.comm
        if cfg.comm_overlapped and cfg.comm_overlapped != cfg.comm_backend:
            self.overlap_comm = make_communicator(cfg.comm_overlapped, self.device)
        self.embeddings = swap(
            self.model, sharding_plan(cfg, self.model), self.comm, self.device,
            mode=MODES[self.schedule_name](), timer=self.timer.section,
            overlap_comm=self.overlap_comm,
            inputs_checked=True,  # the loader checks every training batch (`inputs.find_problem`)
        )  # fmt: skip
        self.swapped = {p: self.model.get_submodule(p) for p in self.model.sharded_modules}
        self.table_entries = TableEntries(self.embeddings)  # what checkpoints hold
        self.dense = DenseSync(self.model, self.timer.seq_mark)
        self.schedule = Schedule(self.embeddings, self.device, self.timer.section)
        # Listed once: `Module.parameters()` walks the module tree on every call.
        self.dense_params = list(self.model.parameters())
        # Fused Adam takes the step's non-finite flag on the device (`found_inf`,
        # as gradient scalers pass it): a skipped step leaves weights, moments
        # and its step count alone without the host reading the flag.
        self.optimizer = torch.optim.Adam(self.dense_params, lr=cfg.dense_lr, fused=True)
        self.default_loss = has_default_loss(self.model)
        self.guard = self.embeddings.guard_nonfinite()
        self.nonfinite = NonFiniteCount(cfg.nonfinite, cfg.nonfinite_max_skips)
        self.autocast = torch.autocast(
            self.device.type, dtype=torch.bfloat16, enabled=cfg.amp == "bf16"
        )
        self.balance = None
        if cfg.balance != "none":
            in_process = cfg.plan_process == "on" or (
                cfg.plan_process == "auto" and self.device.type == "cuda"
            )
            self.balance = BalanceStage(
                balance_partitioner(cfg),
                self.overlap_comm,
                cfg.batch_size,
                self.timer.section,
                in_process,
                adaptive=not cfg.deterministic,
                timeout_s=cfg.timeout_s,
            )
        self.summary = RunSummary(cfg.warmup)
        # Metrics travel over gloo: gathering them never waits for the GPU.
        self.metrics_group = gloo_group(cfg.timeout_s) if self.world > 1 else None
        self.writer = JsonLines(cfg.metrics_path if self.rank == 0 else "", append=bool(cfg.resume))
        self.liveness = Liveness(self.rank, self.world, cfg.timeout_s)
        self.stop_agreed = False  # every rank saw a stop request in the same metrics gather
        limits = Limits.of(self.schema)
        self.inputs = InputAgreement(self.metrics_group, self.rank, self.world, limits)
        self.checkpoints = Checkpointer(
            cfg.checkpoint_dir,
            cfg.checkpoint_every,
            cfg.checkpoint_keep,
            cfg.as_dict(),
            self.metrics_group,
        )
        delayed = applies(cfg.delay_ranks, self.rank)
        self.delay_compute = ComputeDelay(cfg.delay_compute_ms if delayed else 0.0, self.device)
        self.delay_loader_ms = cfg.delay_loader_ms if delayed else 0.0

    # ---- stages ------------------------------------------------------------
    def lookup_features(self, batch: SampleBatch) -> dict[str, Any]:
        """Every table lookup ``batch`` needs, as the collection's features (one call)."""
        features: dict[str, Any] = {}
        for path, value in self.model.embedding_inputs(batch).items():
            module = self.swapped.get(path)
            if module is None:
                raise ValueError(
                    f"embedding_inputs names {path!r}, which is not among the model's "
                    f"sharded_modules {sorted(self.swapped)}"
                )
            features.update(module.lookup_features(value))
        return features

    def _train_step(
        self, batch: SampleBatch, info: BatchInfo, features: dict[str, Any]
    ) -> tuple[Tensor, Tensor]:
        """Launch one step: (its [BCE sum(, loss sum)], its flags of `skip_flags`), read later."""
        global_count = self.schedule.global_count(info)
        batch = batch.with_max_lengths(info.max_uih, info.max_candidates)
        with self.autocast, self.embeddings.serving(features):
            logits = self.dense.ddp(batch)
        self.delay_compute()
        self.schedule.after_forward()
        if self.balance is not None:
            # Here the host is far ahead of the GPU (forward only launched kernels);
            # after backward it is not: the sparse update reads sizes back.
            self.balance.stage3()
        if self.default_loss:
            loss, total = bce_loss_and_sum(logits, batch.labels, global_count)
        else:  # the model's loss; NE stays that of the logits' BCE
            loss, own = self.model.loss(logits, batch, global_count)
            total = torch.stack([bce_total(logits.detach(), batch.labels), own.detach()])
        if min(info.samples, info.uih_tokens, info.candidates) == 0:
            loss = self.dense.cover_all(loss)  # empty parts: every rank reduces every bucket
        loss = self.poison(loss)
        self.guard.begin_step(loss)
        self.dense.last_ready = None
        loss.backward()  # fused sparse update (skipped if any rank saw a non-finite) + dense

        if self.dense.last_ready is not None:
            # Exposed dense all-reduce: from the later of "last bucket ready" and
            # "embedding backward done" (its own sections) to the end of backward.
            start = max(
                self.dense.last_ready, self.timer.last_end or (0, None), key=lambda m: m[0]
            )[1]
            self.timer.add_interval("dense_allreduce", start, self.timer.mark())
        flags = skip_flags(self.guard, self.dense_params, self.device)
        self.optimizer.found_inf = flags[0].float()  # type: ignore[attr-defined]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.balance is not None:
            self.balance.collect()
        return total, flags

    @property
    def schedule_name(self) -> str:
        """The mode's schedule; `freescale` at one rank with ``prioritize=auto``
        is sdd's (measured on 1 H200: the split only added host and GPU work)."""
        cfg = self.cfg
        if cfg.mode == "freescale" and self.world == 1 and cfg.prioritize == "auto":
            return "sdd"
        return cfg.mode

    def poison(self, loss: Tensor) -> Tensor:
        """The loss as given (tests replace this to inject a non-finite step)."""
        return loss

    @property
    def ranked(self) -> bool:
        """File data: evaluation ranks held-out items (`freescale.pipeline.evaluation`)."""
        return hasattr(self.source, "eval_batch")

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """NE on held-out samples (every rank its slice; sums all-reduced);
        file data: ranking metrics of the first ``eval_batches`` validation batches."""
        self.schedule.flush()  # the tables as sync training would have them now
        if self.ranked:
            with self.embeddings.prefetch_disabled():
                return evaluate_split(
                    self.model, self.source, "valid", self.rank, self.world,
                    self.cfg.batch_size, self.device, max_steps=self.cfg.eval_batches,
                )  # fmt: skip
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        with self.embeddings.prefetch_disabled():
            for k in range(self.cfg.eval_batches):
                batch = self.source.batch(
                    EVAL_STEP_OFFSET + k, self.rank, self.world, self.cfg.batch_size
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
    def final_eval(self) -> dict[str, Any]:
        """File data: every user of the validation and test splits, and (rank 0)
        the popularity baseline on the test split; empty for synthetic data."""
        if not self.ranked:
            return {}
        self.schedule.flush()
        with self.embeddings.prefetch_disabled():
            out: dict[str, Any] = {
                split: evaluate_split(
                    self.model,
                    self.source,
                    split,
                    self.rank,
                    self.world,
                    self.cfg.batch_size,
                    self.device,
                )
                for split in ("valid", "test")
            }
        if self.rank == 0:
            out["popularity_test"] = popularity_baseline(self.source, "test")
            out["data"] = self.source.split_counts()
        return out

    # ---- loop --------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        """Replicated state a checkpoint holds besides the tables."""
        state: dict[str, Any] = {"model": DenseState(self), "optimizer": self.optimizer}
        if self.balance is not None:
            state["balancer"] = self.balance
        return state

    def dense_state_dict(self) -> dict[str, Tensor]:
        """The model's state without the sharded tables (no collective)."""
        with self.embeddings.tables_left_out():
            return self.model.state_dict()

    def restore(self) -> int:
        """Load ``cfg.resume`` (if set, written at any world size); the first step
        to run. The data continue where `freescale.pipeline.position` says."""
        if not self.cfg.resume:
            return 0
        # The launcher checked it already; API users get the same one-line errors.
        # The files are checked by every rank together in `Checkpointer.load`.
        path = check_resumable(self.cfg.resume, self.cfg.as_dict(), verify=False)
        self.position = self.checkpoints.load(path, self.table_entries, self._state())
        self.train_source, self.data_position = resumed_source(self.source, self.position)
        return self.position.step

    def samples_before(self, step: int) -> int:
        """Samples (all ranks) consumed before ``step``, resumed runs included."""
        return self.position.samples_at(step, self.world, self.cfg.batch_size)

    def save_checkpoint(self, next_step: int) -> None:
        """Checkpoint a run that continues at ``next_step`` (the tables made exact first)."""
        self.schedule.flush()
        self.checkpoints.save(
            next_step, self.table_entries, self._state(), self.samples_before(next_step)
        )

    def run(self) -> dict[str, Any] | None:
        try:
            first = self.restore()
            if self.cfg.eval_only:  # `freescale eval`: the restored model, no training
                final = self.final_eval() or {"heldout": self.evaluate()}
                return {"step": first, "eval": final} if self.rank == 0 else None
            return self._run_from(first)
        finally:
            self.liveness.close()

    def _run_from(self, first: int) -> dict[str, Any] | None:
        cfg = self.cfg
        loader = Prefetcher(
            self.train_source,
            self.rank,
            self.world,
            cfg.batch_size,
            self.device,
            range(first, cfg.steps),
            host_lengths=host_lengths if self.balance is not None else None,
            workers=cfg.loader_workers if cfg.loader_workers >= 0 else default_workers(self.device),
            delay_ms=self.delay_loader_ms,
            validate=partial(find_problem, limits=self.inputs.limits),
        )
        try:
            return self._loop(loader, first)
        finally:
            loader.close()
            if self.balance is not None:
                self.balance.close()

    def _loop(self, loader: Prefetcher, first: int = 0) -> dict[str, Any] | None:
        cfg = self.cfg
        profiler = self._profiler()
        start = time.perf_counter()
        feed = Feed(loader, self.balance, cfg.steps, self.timer.section, first, self.inputs.check)
        nxt = self._take(feed)
        self.timer.take()  # filling the pipeline is no step's time
        pending: StepRecord | None = None
        host_syncs = contextlib.ExitStack()
        step = first - 1
        for step in range(first, cfg.steps):
            self.liveness.step = step
            if step == cfg.warmup:
                host_syncs.enter_context(report_host_syncs(cfg.sync_debug, self.rank))
            step_start = self.timer.mark()
            batch, info, handle, features = nxt
            feed.start_future(step)  # balancer stage I for step + 2
            if step + 1 < cfg.steps:
                nxt = self._take(feed)
            bce, flags = self._train_step(batch, info, features)
            collision = self.schedule.collision_counts() if step + 1 < cfg.steps else None
            self.timer.add_interval("step", step_start, self.timer.mark())
            on_device = [bce.reshape(-1), flags]
            if math.isnan(info.positives):  # labels moved with the balanced samples
                on_device.append(batch.labels.sum().double().reshape(1))
            values = torch.cat(on_device).double()  # fp32, bools (and fp64): exact in fp64
            record = StepRecord(step, info, read_later(values), self.timer.take(), handle)
            if collision is not None:
                record.collision = read_later(collision)
            if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps):
                record.eval = {"step": step, **self.evaluate()}
            if pending is not None:
                self._finish_step(pending, start)
            pending = record
            if profiler is not None:
                profiler.step()
            if self.stop_agreed or self.checkpoints.due(step):
                self._finish_step(pending, start)  # metrics complete up to this step
                pending = None
                if self.checkpoints.directory is not None:
                    self.save_checkpoint(step + 1)
            if self.stop_agreed:
                break
        self.schedule.flush()
        if pending is not None:
            self._finish_step(pending, start)
        host_syncs.close()
        final = {} if self.stop_agreed else self.final_eval()  # a stop must be quick
        if profiler is not None:
            profiler.stop()
        self.writer.close()
        if self.rank != 0:
            return None
        extra: dict[str, Any] = {
            "mode": cfg.mode,
            "schedule": self.schedule_name,
            "world_size": self.world,
            "device": str(self.device),
            "wall_s": time.perf_counter() - start,
            "first_step": first,
            "nonfinite_skipped": self.nonfinite.skipped,
        }
        if self.data_position:
            extra["resumed"] = resume_record(self.position, self.data_position)
        graphs = getattr(self.model, "graphs", None)
        if graphs is not None:  # captures after warm-up cost step time
            extra["dense_graphs_captured"] = graphs.captures
        if final:
            extra["eval"] = final
            samples = final["data"]["train_samples"]
            extra["epochs"] = self.samples_before(step + 1) / max(samples, 1)
        if self.stop_agreed:
            extra.update(stopped="SIGTERM", last_step=step)
        return self.summary.final(extra)

    def _take(self, feed: Feed) -> tuple[SampleBatch, BatchInfo, Any, dict[str, Any]]:
        """The next batch with its lookups, announced to the schedule."""
        batch, info, handle = feed.take()
        features = self.lookup_features(batch)
        self.schedule.upcoming(features, info)
        return batch, info, handle, features

    def _finish_step(self, rec: StepRecord, start: float) -> None:
        """Metrics of a step, one step later (its events and values are done by then)."""
        sections = self.timer.read_ms(rec.sections)
        step_ms = sections.pop("step")  # includes the data wait
        data_ms = sections.pop("data", 0.0)
        exposed = exposed_by_category(sections)
        collision_part = sum(sections.get(name, 0.0) for name in COLLISION_PART)
        info = rec.info
        values = rec.values()
        loss_sum = None if self.default_loss else values.pop(1)
        bce, skipped, partial, seen_here, *counted = values
        positives = counted[0] if counted else info.positives
        local = RankStep(
            step_ms=step_ms,
            # One clock: every term is an interval of the compute stream (CUDA
            # events) or, on CPU ranks, of the host's wall clock.
            compute_ms=step_ms - sum(exposed.values()) - data_ms,
            data_ms=data_ms,
            exposed=exposed,
            bce_sum=bce,
            positives=positives,
            candidates=info.candidates,
            items=info.uih_tokens + info.candidates,
            samples=info.samples,
            collision_part_ms=collision_part,
            stop=float(self.liveness.stop_requested),
            nonfinite=seen_here,
            features=info.features,
            loss_sum=loss_sum,
        )
        if rec.collision is not None:
            local.collision = tuple(rec.collision())  # type: ignore[assignment]
        table = gather_step(local, self.metrics_group)
        if table[:, STOP].max() > 0 and not self.stop_agreed:
            self.stop_agreed = True  # every rank decides this in the same step
            mark_stopped()
        record = summarize_step(rec.step, table)
        record["nonfinite_skipped"] = bool(skipped)
        self.summary.add(record)
        if rec.handle is not None:
            assert self.balance is not None
            self.balance.observe(record["compute_ms"], rec.handle)
        if rec.eval is not None:
            self.summary.evals.append(rec.eval)
            record["eval_ne"] = rec.eval["ne"]
        self.writer.write(record)
        self._progress(rec.step, record, start)
        # The skip flags are global (agreed in backward; the dense gradients are
        # all-reduced), so every rank takes the same decision here.
        seen = [r for r, x in enumerate(table[:, NONFINITE].tolist()) if x > 0]
        self.nonfinite.count(rec.step, bool(skipped), bool(partial), seen)

    def _progress(self, step: int, record: dict[str, Any], start: float) -> None:
        if self.rank != 0 or not self.cfg.progress:
            return
        every = max(1, self.cfg.steps // 20)
        if (step + 1) % every and step + 1 != self.cfg.steps:
            return
        ne = record.get("eval_ne", record["ne"])
        print(
            f"[{self.cfg.mode}] step {step + 1}/{self.cfg.steps}  {record['step_ms']:.0f} ms"
            f"  qps {record['qps']:.0f}  straggler {record['straggler_pct']:.1f}%  "
            f"ne {ne:.3f}  ({time.perf_counter() - start:.0f} s)",
            file=sys.stderr,
            flush=True,
        )

    def _profiler(self) -> Any:
        if not self.cfg.trace_path:
            return None
        first, last = trace_window(self.cfg.trace_steps or "2-3")
        path = self.cfg.trace_path.replace("{rank}", str(self.rank))
        if self.rank and "{rank}" not in self.cfg.trace_path:  # one file per rank
            stem, dot, ext = path.partition(".json")
            path = f"{stem}.rank{self.rank}{dot}{ext}"

        def save(prof: Any) -> None:
            prof.export_chrome_trace(path)

        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        prof = torch.profiler.profile(
            activities=activities,
            # The step before the window warms the profiler up: the first traced
            # step otherwise carries its start-up cost (idle % of 40+ vs ~20).
            schedule=torch.profiler.schedule(
                wait=max(first - 1, 0), warmup=min(first, 1), active=last - first + 1, repeat=1
            ),
            on_trace_ready=save,
        )
        prof.start()
        return prof


def run_rank(
    cfg: TrainConfig, model: Any = None, data: Any = None, state_dict: bool | None = None
) -> dict[str, Any] | None:
    """Train on this rank (process group initialized); rank 0 returns the summary
    (with ``state_dict`` not None, the Python API's result: `freescale.api`).

    A collective that timed out is re-raised naming the stuck rank(s).
    """
    trainer = Trainer(cfg, model, data)
    try:
        summary = trainer.run()
        if state_dict is None:
            return summary
        state = None
        if state_dict:  # a collective: every rank gathers
            state = full_state_dict(trainer.model, trainer.embeddings, trainer.swapped)
        if trainer.rank != 0:
            return None
        return {"summary": summary, "steps": trainer.summary.steps, "state_dict": state}
    except RuntimeError as e:
        explained = trainer.liveness.explain_timeout(e)
        if explained is None:
            raise
        raise RuntimeError(explained) from e
