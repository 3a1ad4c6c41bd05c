"""The sparse side of a run: the sharded tables and the mode's schedule.

Built from the ``embeddings`` and ``pipeline`` sections and the run's mode:
the model's `sharded_modules` are swapped for one `ShardedEmbeddingCollection`
(`freescale.embedding.swap`), and the schedule (`freescale.pipeline.schedule`)
decides what of a future step's lookups is issued early.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from freescale.comm import make_communicator
from freescale.config import EmbeddingsSection, PipelineSection, RunSection, TrainConfig
from freescale.embedding import (
    SGD,
    Adam,
    RowwiseAdagrad,
    ShardingPlan,
    TableConfig,
    TableEntries,
    swap,
)
from freescale.embedding.collection import host_tier_bytes
from freescale.embedding.host_tier import check_host_memory, ranks_on_host
from freescale.embedding.modes import MODES
from freescale.embedding.optim import OptimizerConfig
from freescale.embedding.table_rows import TableRows
from freescale.jagged.batch import SampleBatch
from freescale.observe.timing import SectionTimer
from freescale.pipeline.lr_schedule import lr_schedule
from freescale.pipeline.schedule import Schedule
from freescale.pipeline.setup import build_model, glob_escape


def embedding_optimizer(section: EmbeddingsSection, steps: int = 0) -> OptimizerConfig:
    """The tables' optimizer; ``steps``: the run's, where its lr schedule ends.

    Weight decay is decoupled (SGD's one form is the same thing) and, like the
    update itself, reaches only the rows a step reads (`freescale.embedding.optim`)."""
    lr, decay = section.lr, section.weight_decay
    schedule = lr_schedule(lr, section.lr_warmup, section.lr_decay, steps)
    if section.optimizer == "sgd":
        return SGD(lr=lr, lr_schedule=schedule, weight_decay=decay)
    if section.optimizer == "adagrad":
        mode = "decoupled" if decay else "l2"  # (the default's, when there is no decay)
        return RowwiseAdagrad(
            lr=lr, lr_schedule=schedule, weight_decay=decay, weight_decay_mode=mode
        )
    return Adam(lr=lr, lr_schedule=schedule, weight_decay=decay)


def sharding_plan(section: EmbeddingsSection, model: nn.Module, steps: int = 0) -> ShardingPlan:
    """Row-wise shard exactly the modules the model names (`sharded_modules`),
    each table where ``embeddings.tables.<name>.placement`` puts it."""
    modules = tuple(model.sharded_modules)  # type: ignore[attr-defined]
    placements, dynamics = section.placements(), section.dynamics()
    for name in section.tables:  # a module path, or a table of a collection under one
        if not any(name == p or name.startswith(p + ".") for p in modules):
            raise ValueError(
                f"embeddings.tables.{name} is not a table of the model's sharded_modules "
                f"{sorted(modules)}"
            )
    return ShardingPlan(
        optimizer=embedding_optimizer(section, steps),
        assignment=section.assignment,
        modules=tuple(glob_escape(p) for p in modules),
        table_placements=placements,  # type: ignore[arg-type]
        table_dynamics=dynamics,
    )


def check_host_tier(cfg: TrainConfig, schema: Any, model: Any, world: int) -> None:
    """Before the model is built: the host-tier tables of this host's ranks fit in
    its memory, or one line saying how much is needed and how much is there.
    The model is sized on the meta device (no memory, no random numbers drawn)."""
    section = cfg.embeddings
    host = {name for name, p in section.placements().items() if p == "host"}
    if not host:
        return
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        model = build_model(cfg.model, schema, model)
    tables = []
    for path in model.sharded_modules:  # type: ignore[attr-defined]
        m = model.get_submodule(path)
        if path in host and isinstance(m, nn.Embedding):
            tables.append(TableConfig(path, m.num_embeddings, m.embedding_dim, m.weight.dtype))
    needed = host_tier_bytes([(embedding_optimizer(section), "host", tables)], world)
    check_host_memory(needed, ranks_on_host(world))


def schedule_name(mode: str, prioritize: str, world: int) -> str:
    """The mode's schedule; `freescale` at one rank with ``prioritize=auto``
    is sdd's (measured on 1 H200: the split only added host and GPU work)."""
    if mode == "freescale" and world == 1 and prioritize == "auto":
        return "sdd"
    return mode


def _communicator(name: str, device: torch.device, options: dict[str, Any]) -> Any:
    return (
        make_communicator(name, device, **options)
        if name != "torch"
        else make_communicator(name, device)
    )


def comm_summary(backend: str, comm: Any) -> dict[str, Any]:
    """The summary's word on one communicator: its backend, and for smfree the
    transport that ran, why, and where the NIXL transport staged its buffers."""
    out: dict[str, Any] = {"backend": backend}
    transport = getattr(comm, "transport", None)
    if transport is None:
        return out
    out.update(transport=transport.name, why=getattr(comm, "why", ""))
    nixl = getattr(transport, "remote", transport)
    if getattr(nixl, "name", "") == "nixl":
        out.update(staging=nixl.staging, staging_why=nixl.staging_why, engine=nixl.backend)
    return out


class SparseSide:
    """The model's tables, sharded over the ranks, and the schedule of ``mode``."""

    def __init__(
        self,
        model: nn.Module,
        section: EmbeddingsSection,
        pipeline: PipelineSection,
        run: RunSection,
        world: int,
        device: torch.device,
        timer: SectionTimer,
    ) -> None:
        """``run``: its mode, and its steps (where an lr schedule ends)."""
        mode, self.steps = run.mode, run.steps
        # A silent peer fails the run after run.timeout_s, naming it.
        options = {
            "timeout": run.timeout_s,
            "staging": pipeline.comm_staging,
            "nixl_backend": pipeline.comm_nixl_backend,
        }
        self.comm = _communicator(pipeline.comm_backend, device, options)
        self.overlap_comm = self.comm
        if pipeline.comm_overlapped and pipeline.comm_overlapped != pipeline.comm_backend:
            self.overlap_comm = _communicator(pipeline.comm_overlapped, device, options)
        self.schedule_name = schedule_name(mode, pipeline.prioritize, world)
        self.embeddings = self._collection(model, section, device, timer)
        self.swapped = {p: model.get_submodule(p) for p in model.sharded_modules}  # type: ignore[union-attr]
        # What each lookup feature may index, and the features of a (host) batch:
        # the loader checks every training batch against the tables as built.
        self.table_rows = TableRows.of(self.embeddings.tables.values())
        self.host_lookups = partial(self.lookup_features, model)
        self.table_entries = TableEntries(self.embeddings)  # what checkpoints hold
        self.schedule = Schedule(self.embeddings, device, timer.section)

    def comm_summary(self, pipeline: PipelineSection) -> dict[str, Any]:
        """The summary's ``comm``: each communicator's backend and the transport that ran."""
        out = {"comm_backend": comm_summary(pipeline.comm_backend, self.comm)}
        if self.overlap_comm is not self.comm:
            out["comm_overlapped"] = comm_summary(pipeline.comm_overlapped, self.overlap_comm)
        return out

    def _collection(
        self, model: nn.Module, section: EmbeddingsSection, device: torch.device, timer: Any
    ) -> Any:
        """The one place the collection is built, its mode and hooks included."""
        embeddings = swap(
            model, sharding_plan(section, model, self.steps), self.comm, device,
            mode=MODES[self.schedule_name](), timer=timer.section,
            overlap_comm=self.overlap_comm,
            inputs_checked=True,  # the loader checks every training batch (`InputAgreement.find`)
        )  # fmt: skip
        self.guard = embeddings.guard_nonfinite()  # skip non-finite steps on every rank
        return embeddings

    def lookup_features(self, model: nn.Module, batch: SampleBatch) -> dict[str, Any]:
        """Every table lookup ``batch`` needs, as the collection's features (one call)."""
        features: dict[str, Any] = {}
        inputs = model.embedding_inputs(batch)  # type: ignore[operator]
        for path, value in inputs.items():
            module = self.swapped.get(path)
            if module is None:
                raise ValueError(
                    f"embedding_inputs names {path!r}, which is not among the model's "
                    f"sharded_modules {sorted(self.swapped)}"
                )
            features.update(module.lookup_features(value))
        if missing := sorted(set(self.swapped) - set(inputs)):  # forward would fail inside
            raise ValueError(
                f"{type(model).__name__}.embedding_inputs(batch) names no input for sharded "
                f"module(s) {missing}: return {{path: the input forward passes it}} for every "
                f"path of sharded_modules, or drop the path from sharded_modules"
            )
        return features
