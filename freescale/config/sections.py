"""The sections of a run's configuration: one frozen dataclass per component.

Each section is validated once, in its ``__post_init__`` (ValueError with one
clear sentence), in the launching process before any rank starts, and handed
whole to the component that owns it (`freescale.config`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from freescale.balance.registry import check_partitioner_name
from freescale.comm import BACKENDS as COMM_BACKENDS
from freescale.comm.nixl_support import STAGINGS as COMM_STAGINGS
from freescale.comm.nixl_support import missing_message, nixl_installed
from freescale.config.values import (
    at_least,
    choice,
    finite,
    integer,
    on_off,
    parse_ranks,
    schedule_keys,
    trace_window,
)
from freescale.embedding.config import PLACEMENTS
from freescale.embedding.dynamic import DynamicSpec
from freescale.embedding.optim import OPTIMIZERS as EMB_OPTIMIZERS
from freescale.naming import FORM, is_named

MODES = ("sync", "sdd", "freescale")
DEVICES = ("auto", "cpu", "cuda")
# embeddings.tables.<name>.<key>: where its shard lives, and a dynamic table's keys
TABLE_KEYS = ("placement", "capacity", "evict", "admit_after")
BUILTIN_MODEL = "freescale.models.sequence:build"
ITEM_TABLE = "item_emb"  # the built-in models' item table (its module path)
RAW_IDS = ("auto", "on", "off")
BEST_METRICS = ("hr@10", "ndcg@10", "auc")
DROPOUT_KEYS = ("emb_dropout", "attn_dropout", "ffn_dropout")  # the built-in models' options


@dataclass(frozen=True)
class RunSection:
    """The job: mode, ranks, device, length, batch, seed, collective timeout."""

    mode: str = "sync"
    nproc: int = 2
    device: str = "cpu"
    steps: int = 150
    warmup: int = 5
    batch_size: int = 32
    seed: int = 0
    deterministic: bool = True
    timeout_s: float = 300.0  # collective timeout: a stuck rank fails the run after this
    # dense bf16 peak TFLOP/s of one device, for MFU (0: from the device's name; none on CPU)
    peak_tflops: float = 0.0
    # file data: this many passes over the training samples, in place of
    # run.steps (0: run.steps counts); whole global batches (`resolve_epochs`)
    epochs: int = 0

    def __post_init__(self) -> None:
        choice("run.mode", self.mode, MODES)
        choice("run.device", self.device, DEVICES)
        at_least(self, "run", ("nproc", "steps", "batch_size"), 1)
        at_least(self, "run", ("warmup", "epochs"), 0)
        if self.warmup >= self.steps:
            raise ValueError(f"run.warmup ({self.warmup}) must be < run.steps ({self.steps})")
        finite("run", "timeout_s", self.timeout_s, 1)
        finite("run", "peak_tflops", self.peak_tflops, 0)


@dataclass(frozen=True)
class DataSection:
    """The data: ``source`` (synthetic | sasrec:PATH | movielens:PATH |
    parquet:PATH | csv:PATH | package.module:factory, called with ``options``)."""

    source: str = "synthetic"
    loader_workers: int = -1  # worker processes per rank (-1: auto, 0 on CPU ranks)
    num_items: int = 2_000
    max_uih: int = 64
    length_median: float = 24.0
    length_sigma: float = 0.8
    length_cap: int = 64
    zipf_alpha: float = 1.05
    step_overlap: float = 1.0  # synthetic: share of ids common to consecutive steps
    max_candidates: int = 4
    max_content: int = 2
    # file data (docs/train-on-your-data.md): training targets per user (0: every
    # target_stride-th prefix), epoch shuffle, negatives per evaluated user
    samples_per_user: int = 1
    target_stride: int = 1
    shuffle: bool = True
    eval_negatives: int = 100
    train_negatives: int = 4  # file data: uniform random negatives per training target
    options: dict[str, Any] = field(default_factory=dict)  # data.KEY=VALUE of a factory
    # file data: a folder of id maps (`ids/` of a checkpoint, an export or `data convert`)
    # the readers remap raw ids through, instead of in order of first appearance
    ids: str = ""
    # item ids as the data's own int64 ids, not rows 0..N-1 (`freescale.data.ids`):
    # auto = file data keeps them where the item table (embeddings.tables.item_emb) is
    # dynamic; on = file data keeps them, synthetic data maps its rows to 64-bit ids
    raw_ids: str = "auto"

    def __post_init__(self) -> None:
        """The data's own configs check the values (`synthetic_configs`); here
        only what they do not: the options' form, the loader, finiteness.
        A local file path is made absolute, so every record of the run names
        the data from any directory."""
        from freescale.data.source import absolute_source

        object.__setattr__(self, "source", absolute_source(self.source))
        object.__setattr__(self, "raw_ids", on_off(self.raw_ids))
        choice("data.raw_ids", self.raw_ids, RAW_IDS)
        if self.ids:
            object.__setattr__(self, "ids", os.path.abspath(os.path.expanduser(self.ids)))
        if not isinstance(self.options, dict):
            raise ValueError("data options are set as data.KEY=VALUE, one key at a time")
        from freescale.data.source import BUILTIN_KINDS

        if self.source.partition(":")[0] not in BUILTIN_KINDS and not is_named(self.source):
            raise ValueError(
                f"data.source must be one of {', '.join(BUILTIN_KINDS)} (with :PATH for files),"
                f" or your own data factory as {FORM}; got {self.source!r}"
            )
        if self.raw_ids == "on" and self.source.partition(":")[0] not in BUILTIN_KINDS:
            raise ValueError(
                "data.raw_ids is for the built-in sources; a data factory's ids are its own"
            )
        if self.raw_ids == "on" and self.ids:
            raise ValueError(
                "data.ids remaps item ids to rows, data.raw_ids=on keeps them: set one"
            )
        if self.loader_workers < -1:
            raise ValueError(
                f"data.loader_workers must be -1 (auto) or >= 0, got {self.loader_workers}"
            )
        at_least(self, "data", ("length_cap",), 1)
        at_least(self, "data", ("train_negatives",), 0)
        for name in ("length_median", "length_sigma", "zipf_alpha", "step_overlap"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"data.{name} must be a finite number, got {getattr(self, name)}")
        try:
            self.synthetic_configs(seed=0)
        except ValueError as e:
            raise ValueError(f"data: {e}") from None

    def synthetic_configs(self, seed: int) -> tuple[Any, Any]:
        """(`SyntheticConfig`, `SequenceSampling`) of the built-in sources."""
        from freescale.data.distributions import LengthDistribution
        from freescale.data.sequences import SequenceSampling
        from freescale.data.synthetic import SyntheticConfig

        lengths = LengthDistribution(
            median=self.length_median, sigma=self.length_sigma, cap=self.length_cap
        )
        synthetic = SyntheticConfig(
            num_items=self.num_items, zipf_alpha=self.zipf_alpha, max_uih=self.max_uih,
            lengths=lengths, max_candidates=self.max_candidates, max_content=self.max_content,
            seed=seed, step_overlap=self.step_overlap, raw_ids=self.raw_ids == "on",
        )  # fmt: skip
        sampling = SequenceSampling(
            max_uih=self.max_uih, samples_per_user=self.samples_per_user,
            stride=self.target_stride, shuffle=self.shuffle,
            eval_negatives=self.eval_negatives, num_negatives=self.train_negatives, seed=seed,
        )  # fmt: skip
        return synthetic, sampling


@dataclass(frozen=True)
class ModelSection:
    """The model: ``factory(schema, **options)``; the options are the model's
    to check (the built-in model's are checked here, by the model's own config)."""

    factory: str = BUILTIN_MODEL
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.options, dict):
            raise ValueError("model options are set as model.KEY=VALUE, one key at a time")
        if not is_named(self.factory):
            raise ValueError(f"model={self.factory!r} must look like {FORM} (a factory)")
        if self.builtin:
            from freescale.models.sequence import check_options

            check_options(**self.options)

    @property
    def builtin(self) -> bool:
        return self.factory == BUILTIN_MODEL


@dataclass(frozen=True)
class EmbeddingsSection:
    """The sharded tables: their optimizer, its learning rate, the row assignment,
    and per table (``tables.<name>.placement``) where its shard lives."""

    optimizer: str = "adagrad"
    lr: float = 0.05
    assignment: str = "hashed"
    # decoupled: an updated row also loses lr x weight_decay x its old value; only
    # the rows a step reads are updated (docs/train-on-your-data.md)
    weight_decay: float = 0.0
    lr_warmup: int = 0  # updates of linear warm-up (`freescale.pipeline.lr_schedule`)
    lr_decay: str = "none"  # none | linear | cosine, to 0 at the run's last step
    # {table: {"placement": "device" | "host", "capacity": rows (0: static), "evict":
    # "lru" | "lfu", "admit_after": K}}; set as embeddings.tables.NAME.KEY=VALUE
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        choice("embeddings.optimizer", self.optimizer, tuple(EMB_OPTIMIZERS))
        choice("embeddings.assignment", self.assignment, ("hashed", "block"))
        finite("embeddings", "lr", self.lr, 0, strict=True)
        schedule_keys("embeddings", self)
        for name, keys in self.tables.items():
            for key in keys:
                choice(f"embeddings.tables.{name}.{key}", key, TABLE_KEYS)
            if "placement" in keys:
                choice(f"embeddings.tables.{name}.placement", keys["placement"], PLACEMENTS)
        self.dynamics()

    def placements(self) -> dict[str, str]:
        return {
            name: keys["placement"] for name, keys in self.tables.items() if "placement" in keys
        }

    def dynamics(self) -> dict[str, DynamicSpec]:
        """The dynamic tables (``capacity`` > 0), by name; one line for a bad key."""
        out = {}
        for name, keys in self.tables.items():
            prefix = f"embeddings.tables.{name}"
            capacity = integer(f"{prefix}.capacity", keys.get("capacity", 0))
            if capacity < 0:
                raise ValueError(
                    f"{prefix}.capacity must be >= 0 (0: a static table), got {capacity}"
                )
            if not capacity:
                for key in ("evict", "admit_after"):
                    if key in keys:
                        raise ValueError(
                            f"{prefix}.{key} needs {prefix}.capacity > 0 (a dynamic table)"
                        )
                continue
            admit = integer(f"{prefix}.admit_after", keys.get("admit_after", 1))
            try:
                out[name] = DynamicSpec(capacity, str(keys.get("evict", "lru")), admit)
            except ValueError as e:
                raise ValueError(f"{prefix}: {e}") from None
        return out


@dataclass(frozen=True)
class DenseSection:
    """Dense training: Adam's lr, bf16 autocast, CUDA graphs of the block stack,
    regional torch.compile of the model's blocks."""

    lr: float = 3e-3
    amp: str = "none"  # none | bf16 (autocast of the dense model on CUDA)
    # CUDA graphs of the dense blocks, one per padded shape: far fewer host
    # launches at small batches; close to (not bitwise equal to) eager numbers
    graphs: bool = False
    # ...but only for runs of at most this many UIH tokens per step (batch_size x
    # max_uih; 0: no limit): above it the GPU, not the host, sets the step time,
    # and the padding to buckets costs more than the launches saved (eager runs)
    graph_max_tokens: int = 131_072
    # inside those graphs, the candidate path on its own stream (2) or not (1):
    # same kernels, same numbers; 1 is the reference of an A/B
    graph_streams: int = 2
    # torch.compile of each block (the model's `compile_regions`), token dimension
    # dynamic: the memory-bound work around the attention fused, forward and
    # backward; numbers within rounding of eager. Not with graphs that run (the
    # summary's `dense_compile` says which ran); on the CPU too when asked
    compile: bool = False
    # AdamW's decoupled decay of the weight matrices (biases and norms: none)
    weight_decay: float = 0.0
    lr_warmup: int = 0  # steps of linear warm-up (`freescale.pipeline.lr_schedule`)
    lr_decay: str = "none"  # none | linear | cosine, to 0 at the run's last step

    def __post_init__(self) -> None:
        if not isinstance(self.compile, bool):
            raise ValueError(f"dense.compile must be true or false, got {self.compile!r}")
        choice("dense.amp", self.amp, ("none", "bf16"))
        finite("dense", "lr", self.lr, 0, strict=True)
        schedule_keys("dense", self)
        if self.graph_max_tokens < 0:
            raise ValueError(f"dense.graph_max_tokens must be >= 0, got {self.graph_max_tokens}")
        if self.graph_streams not in (1, 2):
            raise ValueError(f"dense.graph_streams must be 1 or 2, got {self.graph_streams}")


@dataclass(frozen=True)
class BalanceSection:
    """Sequence load balancing (docs/balance.md)."""

    # none | fbs | vbs | cost | a register_partitioner name | module:qualname (user code)
    method: str = "none"
    plan_process: str = "auto"  # partition in a helper process: auto (on GPUs) | on | off
    counts: str = "equal"  # method=cost: equal | variable local batch sizes
    max_local_batch: int = 0  # counts=variable: per-rank cap (0: 2 x batch_size)

    def __post_init__(self) -> None:
        check_partitioner_name(self.method, "balance.method")
        choice("balance.plan_process", self.plan_process, ("auto", "on", "off"))
        choice("balance.counts", self.counts, ("equal", "variable"))
        if self.counts == "variable" and self.method != "cost":
            raise ValueError("balance.counts=variable needs balance.method=cost")
        at_least(self, "balance", ("max_local_batch",), 0)


@dataclass(frozen=True)
class PipelineSection:
    """The schedule and its communication."""

    # freescale's prioritized updates hide the exclusive rows' gradient exchange
    # and update behind the next step; at one rank there is no exchange and one
    # stream, so "auto" runs freescale there with sdd's schedule (same numbers,
    # less work); "on" keeps the split at any world size
    prioritize: str = "auto"
    comm_backend: str = "torch"  # torch | smfree[-shm|-gloo|-hier|-nixl] (docs/comm.md)
    # backend of the exchanges issued ahead of their use (balancer stage III, the
    # embedding prefetches, deferred gradients); empty: the same as comm_backend
    comm_overlapped: str = ""
    # the NIXL transport's buffers: host (pinned, D2H/H2D staged) | device (GPU memory
    # registered, GPUDirect) | auto (device where UCX takes GPU memory); its engine
    comm_staging: str = "auto"
    comm_nixl_backend: str = "UCX"  # UCX | LIBFABRIC (EFA)
    sync_debug: bool = False  # print every host wait for the GPU (after warm-up)

    def __post_init__(self) -> None:
        choice("pipeline.prioritize", self.prioritize, ("auto", "on"))
        choice("pipeline.comm_backend", self.comm_backend, COMM_BACKENDS)
        if self.comm_overlapped:
            choice("pipeline.comm_overlapped", self.comm_overlapped, COMM_BACKENDS)
        choice("pipeline.comm_staging", self.comm_staging, COMM_STAGINGS)
        choice("pipeline.comm_nixl_backend", self.comm_nixl_backend, ("UCX", "LIBFABRIC"))
        for key in ("comm_backend", "comm_overlapped"):
            if getattr(self, key) == "smfree-nixl" and not nixl_installed():
                raise ValueError(missing_message(f"pipeline.{key}=smfree-nixl"))


@dataclass(frozen=True)
class EvaluationSection:
    every: int = 30  # steps between held-out evaluations (0: none during training)
    # with run.epochs: evaluate every this many epochs instead (sets `every`
    # once the data gives an epoch's steps, `setup.resolve_epochs`)
    every_epochs: int = 0
    batches: int = 4  # batches per evaluation
    # file data: every evaluation covers the whole validation split, and the
    # final one uses the weights of the best of them by this metric (hr@10 |
    # ndcg@10 | auc), reported with its step and epoch (`freescale.state.best`)
    keep_best: str = ""
    patience: int = 0  # with keep_best: stop after this many evaluations without a new best

    def __post_init__(self) -> None:
        at_least(self, "evaluation", ("every", "every_epochs", "patience"), 0)
        at_least(self, "evaluation", ("batches",), 1)
        if self.keep_best:
            choice("evaluation.keep_best", self.keep_best, BEST_METRICS)
            if not (self.every or self.every_epochs):
                raise ValueError(
                    "evaluation.keep_best needs evaluation.every or evaluation.every_epochs > 0"
                )
        elif self.patience:
            raise ValueError("evaluation.patience needs evaluation.keep_best")


@dataclass(frozen=True)
class CheckpointSection:
    dir: str = ""  # where checkpoints go; empty = none
    every: int = 0  # steps between checkpoints (0: only on SIGTERM)
    keep: int = 2  # newest complete checkpoints kept
    # a checkpoint, or a checkpoint dir (its newest); empty = start at 0; "auto": the
    # newest complete one in checkpoint.dir if there is one, else start at 0 (one
    # command line for the first start and every restart: elastic jobs)
    resume: str = ""

    def __post_init__(self) -> None:
        at_least(self, "checkpoint", ("every",), 0)
        at_least(self, "checkpoint", ("keep",), 1)


@dataclass(frozen=True)
class FaultsSection:
    """Injected faults (they check the metrics and the guard) and the non-finite guard."""

    delay_compute_ms: float = 0.0  # extra compute per step
    delay_loader_ms: float = 0.0  # the loader hands out a batch per that many ms at most
    delay_ranks: str = ""  # ranks delayed, e.g. "1" or "0,2"; empty = all
    # a step whose loss or gradients are not finite on some rank changes nothing on
    # any rank and is counted; "raise" fails the run after nonfinite_max_skips
    # consecutive skipped steps (0: on the first), "skip" never does
    nonfinite: str = "raise"
    nonfinite_max_skips: int = 3
    nan_steps: str = ""  # steps whose loss is made NaN, e.g. "3" or "3,4"; empty = none
    nan_ranks: str = ""  # ranks where that happens; empty = all

    def __post_init__(self) -> None:
        finite("faults", "delay_compute_ms", self.delay_compute_ms, 0)
        finite("faults", "delay_loader_ms", self.delay_loader_ms, 0)
        choice("faults.nonfinite", self.nonfinite, ("raise", "skip"))
        at_least(self, "faults", ("nonfinite_max_skips",), 0)
        for name in ("delay_ranks", "nan_steps", "nan_ranks"):
            try:
                parse_ranks(getattr(self, name))
            except ValueError:
                raise ValueError(
                    f"faults.{name} must be comma-separated numbers >= 0, "
                    f"got {getattr(self, name)!r}"
                ) from None


@dataclass(frozen=True)
class OutputSection:
    metrics_path: str = ""  # one JSON line per step (rank 0)
    trace_path: str = ""  # a profiler trace ("{rank}" in it: one file per rank)
    trace_steps: str = ""  # its steps, e.g. "10-12" (default 2-3)
    progress: bool = True
    # a run directory (`freescale.run.run_dir`): the paths above left empty,
    # the checkpoints' too, go there; empty: each path as given
    dir: str = ""
    tensorboard: bool = False  # step metrics and evaluations as scalars, in ``dir``

    def __post_init__(self) -> None:
        if self.trace_steps:
            trace_window(self.trace_steps)
        if self.tensorboard and not self.dir:
            raise ValueError("output.tensorboard=true needs output.dir (the run directory)")


SECTIONS: dict[str, type] = {
    "run": RunSection,
    "data": DataSection,
    "model": ModelSection,
    "embeddings": EmbeddingsSection,
    "dense": DenseSection,
    "balance": BalanceSection,
    "pipeline": PipelineSection,
    "evaluation": EvaluationSection,
    "checkpoint": CheckpointSection,
    "faults": FaultsSection,
    "output": OutputSection,
}
