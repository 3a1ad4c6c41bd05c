"""Training configuration by component: one frozen section per owner.

Each section is validated once, in its ``__post_init__`` (ValueError with
one clear sentence), in the launching process before any rank starts, and
handed whole to the component that owns it: ``run`` (the job), ``data``
(the data source), ``model`` (the factory and its options: the model checks
those itself), ``embeddings`` (the sharded tables), ``dense`` (the dense
optimizer), ``balance``, ``pipeline`` (schedule and communication),
``evaluation``, ``checkpoint``, ``faults`` (injected faults and the
non-finite guard) and ``output``.

On the command line every key is ``--set section.key=value``; ``data=``,
``model=`` and ``balance=`` are shorthands of ``data.source``,
``model.factory`` and ``balance.method``; ``data.KEY`` / ``model.KEY``
outside the section's fields are options of the data / model factory.
The flat keys of the old single-dataclass config keep working for one
release through `ALIASES` (a deprecation notice per old key).
"""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from freescale.comm import BACKENDS as COMM_BACKENDS
from freescale.pipeline.faults import parse_ranks

MODES = ("sync", "sdd", "freescale")
BALANCE = ("none", "fbs", "vbs", "cost")
DEVICES = ("auto", "cpu", "cuda")
EMB_OPTIMIZERS = ("sgd", "adagrad", "adam")
PLACEMENTS = ("device", "host")  # `freescale.embedding.config.PLACEMENTS`
TABLE_KEYS = ("placement",)  # embeddings.tables.<name>.<key>
BUILTIN_MODEL = "freescale.models.sequence:build"
LR_DECAYS = ("none", "linear", "cosine")
BEST_METRICS = ("hr@10", "ndcg@10", "auc")
DROPOUT_KEYS = ("emb_dropout", "attn_dropout", "ffn_dropout")  # the built-in models' options


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def _at_least(section: object, prefix: str, names: tuple[str, ...], low: int) -> None:
    for name in names:
        value = getattr(section, name)
        if value < low:
            raise ValueError(f"{prefix}.{name} must be >= {low}, got {value}")


def _schedule_keys(prefix: str, section: Any) -> None:
    """The optimizer keys shared by ``dense`` and ``embeddings``."""
    _finite(prefix, "weight_decay", section.weight_decay, 0)
    _at_least(section, prefix, ("lr_warmup",), 0)
    _choice(f"{prefix}.lr_decay", section.lr_decay, LR_DECAYS)


def _finite(prefix: str, name: str, value: float, low: float, strict: bool = False) -> None:
    if not (math.isfinite(value) and (value > low if strict else value >= low)):
        sign = ">" if strict else ">="
        raise ValueError(f"{prefix}.{name} must be a finite number {sign} {low:g}, got {value}")


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
        _choice("run.mode", self.mode, MODES)
        _choice("run.device", self.device, DEVICES)
        _at_least(self, "run", ("nproc", "steps", "batch_size"), 1)
        _at_least(self, "run", ("warmup", "epochs"), 0)
        if self.warmup >= self.steps:
            raise ValueError(f"run.warmup ({self.warmup}) must be < run.steps ({self.steps})")
        _finite("run", "timeout_s", self.timeout_s, 1)
        _finite("run", "peak_tflops", self.peak_tflops, 0)


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
    options: dict[str, Any] = field(default_factory=dict)  # data.KEY=VALUE of a factory

    def __post_init__(self) -> None:
        """The data's own configs check the values (`synthetic_configs`); here
        only what they do not: the options' form, the loader, finiteness."""
        if not isinstance(self.options, dict):
            raise ValueError("data options are set as data.KEY=VALUE, one key at a time")
        if self.loader_workers < -1:
            raise ValueError(
                f"data.loader_workers must be -1 (auto) or >= 0, got {self.loader_workers}"
            )
        _at_least(self, "data", ("length_cap",), 1)
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
            seed=seed, step_overlap=self.step_overlap,
        )  # fmt: skip
        sampling = SequenceSampling(
            max_uih=self.max_uih, samples_per_user=self.samples_per_user,
            stride=self.target_stride, shuffle=self.shuffle,
            eval_negatives=self.eval_negatives, seed=seed,
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
        if ":" not in self.factory:
            raise ValueError(f"model={self.factory!r} must look like package.module:factory")
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
    # {table: {"placement": "device" | "host"}}; set as embeddings.tables.NAME.placement=host
    tables: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _choice("embeddings.optimizer", self.optimizer, EMB_OPTIMIZERS)
        _choice("embeddings.assignment", self.assignment, ("hashed", "block"))
        _finite("embeddings", "lr", self.lr, 0, strict=True)
        _schedule_keys("embeddings", self)
        for name, keys in self.tables.items():
            for key, value in keys.items():
                _choice(f"embeddings.tables.{name}.{key}", key, TABLE_KEYS)
                _choice(f"embeddings.tables.{name}.placement", value, PLACEMENTS)

    def placements(self) -> dict[str, str]:
        return {name: keys["placement"] for name, keys in self.tables.items() if keys}


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
        _choice("dense.amp", self.amp, ("none", "bf16"))
        _finite("dense", "lr", self.lr, 0, strict=True)
        _schedule_keys("dense", self)
        if self.graph_max_tokens < 0:
            raise ValueError(f"dense.graph_max_tokens must be >= 0, got {self.graph_max_tokens}")
        if self.graph_streams not in (1, 2):
            raise ValueError(f"dense.graph_streams must be 1 or 2, got {self.graph_streams}")


@dataclass(frozen=True)
class BalanceSection:
    """Sequence load balancing (docs/balance.md)."""

    method: str = "none"  # none | fbs | vbs | cost
    plan_process: str = "auto"  # partition in a helper process: auto (on GPUs) | on | off
    counts: str = "equal"  # method=cost: equal | variable local batch sizes
    max_local_batch: int = 0  # counts=variable: per-rank cap (0: 2 x batch_size)

    def __post_init__(self) -> None:
        _choice("balance.method", self.method, BALANCE)
        _choice("balance.plan_process", self.plan_process, ("auto", "on", "off"))
        _choice("balance.counts", self.counts, ("equal", "variable"))
        if self.counts == "variable" and self.method != "cost":
            raise ValueError("balance.counts=variable needs balance.method=cost")
        _at_least(self, "balance", ("max_local_batch",), 0)


@dataclass(frozen=True)
class PipelineSection:
    """The schedule and its communication."""

    # freescale's prioritized updates hide the exclusive rows' gradient exchange
    # and update behind the next step; at one rank there is no exchange and one
    # stream, so "auto" runs freescale there with sdd's schedule (same numbers,
    # less work); "on" keeps the split at any world size
    prioritize: str = "auto"
    comm_backend: str = "torch"  # torch | smfree[-shm|-gloo|-hier] (docs/comm.md)
    # backend of the exchanges issued ahead of their use (balancer stage III, the
    # embedding prefetches, deferred gradients); empty: the same as comm_backend
    comm_overlapped: str = ""
    sync_debug: bool = False  # print every host wait for the GPU (after warm-up)

    def __post_init__(self) -> None:
        _choice("pipeline.prioritize", self.prioritize, ("auto", "on"))
        _choice("pipeline.comm_backend", self.comm_backend, COMM_BACKENDS)
        if self.comm_overlapped:
            _choice("pipeline.comm_overlapped", self.comm_overlapped, COMM_BACKENDS)


@dataclass(frozen=True)
class EvaluationSection:
    every: int = 30  # steps between held-out evaluations (0: none during training)
    batches: int = 4  # batches per evaluation
    # file data: every evaluation covers the whole validation split, and the
    # final one uses the weights of the best of them by this metric (hr@10 |
    # ndcg@10 | auc), reported with its step and epoch (`freescale.pipeline.best`)
    keep_best: str = ""
    patience: int = 0  # with keep_best: stop after this many evaluations without a new best

    def __post_init__(self) -> None:
        _at_least(self, "evaluation", ("every", "patience"), 0)
        _at_least(self, "evaluation", ("batches",), 1)
        if self.keep_best:
            _choice("evaluation.keep_best", self.keep_best, BEST_METRICS)
            if not self.every:
                raise ValueError("evaluation.keep_best needs evaluation.every > 0")
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
        _at_least(self, "checkpoint", ("every",), 0)
        _at_least(self, "checkpoint", ("keep",), 1)


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
        _finite("faults", "delay_compute_ms", self.delay_compute_ms, 0)
        _finite("faults", "delay_loader_ms", self.delay_loader_ms, 0)
        _choice("faults.nonfinite", self.nonfinite, ("raise", "skip"))
        _at_least(self, "faults", ("nonfinite_max_skips",), 0)
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
    # a run directory (`freescale.pipeline.run_dir`): the paths above left empty,
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
SHORTHANDS = {"data": "data.source", "model": "model.factory", "balance": "balance.method"}
OPTION_SECTIONS = ("data", "model")  # their other keys are factory options


@dataclass(frozen=True)
class TrainConfig:
    """A run's configuration: one section per component (see the module docstring).

    ``eval_only`` is no key: `freescale eval` sets it (restore, evaluate, no training)."""

    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    embeddings: EmbeddingsSection = field(default_factory=EmbeddingsSection)
    dense: DenseSection = field(default_factory=DenseSection)
    balance: BalanceSection = field(default_factory=BalanceSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    faults: FaultsSection = field(default_factory=FaultsSection)
    output: OutputSection = field(default_factory=OutputSection)
    eval_only: bool = False

    def __post_init__(self) -> None:
        # The only checks across sections: each names both keys.
        if self.checkpoint.every and not (self.checkpoint.dir or self.output.dir):
            raise ValueError(
                "checkpoint.every needs checkpoint.dir (where to write them) or output.dir"
            )
        if self.checkpoint.resume == "auto" and not (self.checkpoint.dir or self.output.dir):
            raise ValueError(
                "checkpoint.resume=auto needs checkpoint.dir (where to look) or output.dir"
            )
        cap = self.balance.max_local_batch
        if cap and cap < self.run.batch_size:
            raise ValueError(
                f"balance.max_local_batch must be 0 or >= run.batch_size ({self.run.batch_size})"
            )
        if self.evaluation.keep_best and self.checkpoint.resume and not self.eval_only:
            raise ValueError(
                "evaluation.keep_best cannot resume yet (checkpoints do not hold the best "
                "weights): drop checkpoint.resume or keep_best"
            )
        dropout = [k for k in DROPOUT_KEYS if self.model.options.get(k)]
        if dropout and (self.dense.graphs or self.dense.compile):
            raise ValueError(
                f"model.{dropout[0]} needs eager dense blocks (dense.graphs and dense.compile off)"
            )
        if not self.run.epochs:  # else once the data gives the steps (`setup.resolve_epochs`)
            self.check_warmups(self.run.steps)

    def check_warmups(self, steps: int) -> None:
        """The lr warm-ups end before the run's ``steps`` do."""
        for name in ("dense", "embeddings"):
            warmup = getattr(self, name).lr_warmup
            if warmup >= steps:
                raise ValueError(f"{name}.lr_warmup ({warmup}) must be < the run's steps ({steps})")

    def __getattr__(self, name: str) -> Any:
        """An old flat key read as an attribute (``cfg.batch_size``): its
        section's value, with a DeprecationWarning (one release)."""
        path = ALIASES.get(name) if not name.startswith("_") else None
        if path is None:
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        warnings.warn(notice_text(name, path), DeprecationWarning, stacklevel=2)
        section, _, key = path.partition(".")
        values = getattr(self, section)
        if section == "model" and key != "options":
            return values.options.get(key)
        return getattr(values, key)

    def as_dict(self) -> dict[str, Any]:
        """``{section: {key: value}}`` (what manifests and --print-config hold)."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        return {**out, "eval_only": self.eval_only} if self.eval_only else out

    @staticmethod
    def from_dict(values: dict[str, Any]) -> TrainConfig:
        """The inverse of `as_dict`; a flat dict (an old manifest) is mapped by `ALIASES`."""
        if not any(isinstance(v, dict) and k in SECTIONS for k, v in values.items()):
            values = nested_from_flat(values)
        sections = {k: SECTIONS[k](**v) for k, v in values.items() if k in SECTIONS}
        return TrainConfig(**sections, eval_only=bool(values.get("eval_only", False)))

    def with_values(self, **paths: Any) -> TrainConfig:
        """A copy with ``section__key=value`` (or ``section=Section``) replaced."""
        changes: dict[str, Any] = {}
        for path, value in paths.items():
            name, _, key = path.partition("__")
            if not key:
                changes[name] = value
                continue
            current = changes.get(name, getattr(self, name))
            changes[name] = replace(current, **{key: value})
        return replace(self, **changes)


def trace_window(text: str) -> tuple[int, int]:
    """``"10-12"`` -> (10, 12): the steps a profiler trace covers (inclusive)."""
    try:
        a, b = (int(x) for x in text.split("-"))
    except ValueError:
        raise ValueError(f"output.trace_steps must look like '10-12', got {text!r}") from None
    if not 0 <= a <= b:
        raise ValueError(f"output.trace_steps must be an increasing range, got {text!r}")
    return a, b


# ---- the old flat keys (one release) ---------------------------------------------------
_SAME_NAME = {
    # newer than the flat keys: peak_tflops, epochs
    "run": [f.name for f in fields(RunSection) if f.name not in ("peak_tflops", "epochs")],
    "data": [f.name for f in fields(DataSection) if f.name not in ("source", "options")],
    "embeddings": [],
    "pipeline": [f.name for f in fields(PipelineSection)],
    "faults": [f.name for f in fields(FaultsSection) if not f.name.startswith("nan_")],
    "output": [f.name for f in fields(OutputSection) if f.name not in ("dir", "tensorboard")],
}
ALIASES: dict[str, str] = {
    **{key: f"{section}.{key}" for section, keys in _SAME_NAME.items() for key in keys},
    "data_options": "data.options",
    "model_options": "model.options",
    "dim": "model.dim",
    "heads": "model.heads",
    "layers": "model.layers",
    "attention": "model.attention",
    "item_dim": "model.dim",  # the table's dim is the model's: equal or an error
    "amp": "dense.amp",
    "dense_graphs": "dense.graphs",
    "dense_graph_streams": "dense.graph_streams",
    "dense_lr": "dense.lr",
    "emb_optimizer": "embeddings.optimizer",
    "emb_lr": "embeddings.lr",
    "assignment": "embeddings.assignment",
    "plan_process": "balance.plan_process",
    "balance_counts": "balance.counts",
    "max_local_batch": "balance.max_local_batch",
    "eval_every": "evaluation.every",
    "eval_batches": "evaluation.batches",
    "checkpoint_dir": "checkpoint.dir",
    "checkpoint_every": "checkpoint.every",
    "checkpoint_keep": "checkpoint.keep",
    "resume": "checkpoint.resume",
}


def nested_from_flat(flat: dict[str, Any]) -> dict[str, Any]:
    """An old flat config dict (a manifest) as ``{section: {key: value}}``."""
    out: dict[str, Any] = {name: {} for name in SECTIONS}
    for key, value in flat.items():
        if key == "eval_only":
            out[key] = value
            continue
        path = SHORTHANDS.get(key) or ALIASES.get(key)
        if path is None or key == "item_dim":
            continue  # a key that no longer exists (item_dim follows model.dim)
        section, _, name = path.partition(".")
        if key == "model":
            value = value or BUILTIN_MODEL
        elif section == "model" and name != "options":
            # The built-in model's keys: another factory never got them.
            if not flat.get("model"):
                out["model"].setdefault("options", {})[name] = value
            continue
        if name != "options":
            out[section][name] = value
    for section in OPTION_SECTIONS:  # the factory's own options win, as they did
        given = flat.get(f"{section}_options") or {}
        out[section]["options"] = {**out[section].get("options", {}), **given}
    return out


# ---- presets ---------------------------------------------------------------------------
def demo() -> TrainConfig:
    """The README demo: 2 gloo ranks on the CPU, a small model, long-tail data."""
    return TrainConfig(model=ModelSection(options={"dim": 32, "heads": 2, "layers": 1}))


def _h200(max_uih: int) -> TrainConfig:
    """GPU runs (one process per GPU): the paper's long-UIH regime, bf16 autocast."""
    return TrainConfig(
        run=RunSection(
            device="cuda", nproc=2, steps=60, warmup=10, batch_size=64, deterministic=False
        ),
        data=DataSection(
            num_items=10_000_000,
            max_uih=max_uih,
            length_median=4_500,
            length_sigma=0.55,
            length_cap=17_000,
            max_candidates=8,
            max_content=4,
        ),
        model=ModelSection(options={"dim": 256, "heads": 4, "layers": 4}),
        dense=DenseSection(amp="bf16"),
        evaluation=EvaluationSection(every=0),
    )


def h200_8k() -> TrainConfig:
    return _h200(8_000)


def h200_21k() -> TrainConfig:
    return _h200(21_000)


def _recipe(name: str) -> Callable[[], TrainConfig]:
    """A recipe of `freescale.pipeline.recipes` (imported when built: it imports this)."""

    def make() -> TrainConfig:
        from freescale.pipeline.recipes import RECIPES

        return RECIPES[name]()

    return make


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "demo": demo,
    "h200-8k": h200_8k,
    "h200-21k": h200_21k,
    "sasrec-sequence": _recipe("sasrec-sequence"),  # docs/train-on-your-data.md
    "sasrec-hstu": _recipe("sasrec-hstu"),
}


# ---- key=value overrides ---------------------------------------------------------------
def parse_value(field_type: Any, key: str, text: str) -> Any:
    kind = field_type if isinstance(field_type, str) else getattr(field_type, "__name__", "")
    try:
        if kind == "bool":
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            return int(text.replace("_", ""))
        if kind == "float":
            return float(text)
    except ValueError:
        raise ValueError(f"{key} expects a {kind}, got {text!r}") from None
    return text


def option_value(text: str) -> Any:
    """A factory option's value: a JSON literal (number, true, [1, 2], ...) or the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def known_keys() -> list[str]:
    """Every ``section.key`` (what ``--set`` accepts besides factory options)."""
    return [
        f"{name}.{f.name}"
        for name, cls in SECTIONS.items()
        for f in fields(cls)
        if f.name != "options"
    ]


def _types() -> dict[str, Any]:
    return {f"{n}.{f.name}": f.type for n, cls in SECTIONS.items() for f in fields(cls)}


def deprecation_warning(key: str, path: str) -> None:
    """The default notice of an old flat key: a DeprecationWarning (library callers)."""
    warnings.warn(notice_text(key, path), DeprecationWarning, stacklevel=4)


def notice_text(key: str, path: str) -> str:
    return f"config key {key!r} is deprecated (removed next release): use {path!r}"


class _Values:
    """A config being built: ``{section: {key: value}}`` plus what was set how."""

    def __init__(self, base: TrainConfig) -> None:
        self.values = base.as_dict()
        self.base_factory = base.model.factory
        self.set_options: dict[str, Any] = {}  # model options set explicitly
        self.item_dim: int | None = None

    def set(self, path: str, value: Any) -> None:
        section, _, key = path.partition(".")
        if key == "options":
            if section == "model":
                self.set_options.update(value)
            self.values[section]["options"] = {**self.values[section]["options"], **value}
        elif section == "model" and key != "factory":
            self.set_options[key] = value
            self.values["model"]["options"][key] = value
        else:
            self.values[section][key] = value

    def set_table_key(self, path: str, text: str) -> None:
        """``embeddings.tables.NAME.KEY=VALUE`` (NAME may hold dots: a module path)."""
        name, _, key = path.removeprefix("embeddings.tables.").rpartition(".")
        if not name:
            raise ValueError(f"{path!r} must look like embeddings.tables.NAME.placement")
        tables = {k: dict(v) for k, v in self.values["embeddings"]["tables"].items()}
        tables.setdefault(name, {})[key] = text
        self.values["embeddings"]["tables"] = tables

    def build(self) -> TrainConfig:
        model = self.values["model"]
        if model["factory"] != self.base_factory:
            # The preset's options were the built-in model's: another factory gets
            # only those set for it.
            model["options"] = dict(self.set_options)
        if self.item_dim is not None and self.item_dim != model["options"].get("dim"):
            raise ValueError(
                f"item table dim mismatch: item_dim={self.item_dim} but the model's dim is "
                f"{model['options'].get('dim')} (the table's dim follows model.dim)"
            )
        return TrainConfig.from_dict(self.values)


def build_config(
    preset: str = "demo",
    overrides: list[str] | None = None,
    on_deprecated: Callable[[str, str], None] | None = None,
) -> TrainConfig:
    """A preset with ``section.key=value`` overrides applied; unknown keys are errors.

    ``data.KEY=VALUE`` / ``model.KEY=VALUE`` outside the section's fields become
    options of the data source / model factory (JSON literals, else strings).
    An old flat key is mapped by `ALIASES` and reported to ``on_deprecated(key,
    new path)`` (default: a DeprecationWarning)."""
    builder = ConfigBuilder(preset, on_deprecated)
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must look like key=value")
        builder.set(key.strip(), text.strip())
    return builder.build()


class ConfigBuilder:
    """A preset with keys set one at a time: ``--set`` text (`set`) or typed
    values of a config file (`set_value`); each key's errors are raised as it
    is set, the sections' own checks at `build`."""

    def __init__(
        self, preset: str = "demo", on_deprecated: Callable[[str, str], None] | None = None
    ) -> None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        self.notify = on_deprecated or deprecation_warning
        self.types = _types()
        self.state = _Values(PRESETS[preset]())

    def set(self, key: str, text: str) -> None:
        """``key=text`` as on the command line (the text parsed by the key's type)."""
        self._apply(key, text, parse_value, option_value)

    def set_value(self, key: str, value: Any) -> None:
        """``key`` to a typed value (a config file's): its type must be the key's."""
        self._apply(key, value, typed_value, lambda v: v)

    def set_options(self, section: str, options: Any) -> None:
        """A factory's options as a whole table (``[data.options]`` of a file)."""
        if not isinstance(options, dict):
            raise ValueError(f"{section}.options must be a table of the factory's options")
        self.state.set(f"{section}.options", options)

    def build(self) -> TrainConfig:
        return self.state.build()

    def _apply(self, key: str, value: Any, parse: Callable, option: Callable) -> None:
        path = SHORTHANDS.get(key) or key
        section, _, name = path.partition(".")
        if key in ("data_options", "model_options"):
            raise ValueError(f"{key} is set as {key.split('_')[0]}.KEY=VALUE, one key at a time")
        if path not in self.types and key in ALIASES:  # an old flat key
            path = ALIASES[key]
            self.notify(key, path)
            section, _, name = path.partition(".")
            if key == "item_dim":
                self.state.item_dim = parse("int", key, value)
                return
        if section in OPTION_SECTIONS and name and path not in self.types:
            self.state.set(f"{section}.options", {name: option(value)})
            return
        if path.startswith("embeddings.tables."):
            self.state.set_table_key(path, value)
            return
        if path not in self.types:
            raise ValueError(
                f"unknown config key {key!r}; keys are section.key: {', '.join(known_keys())}"
            )
        value = parse(self.types[path], key, value)
        if path == "model.factory" and not value:
            value = BUILTIN_MODEL  # the old "model=" (empty): the built-in model
        self.state.set(path, value)


def typed_value(field_type: Any, key: str, value: Any) -> Any:
    """A config file's value for ``key``, checked against its type (an int
    where a float goes is fine; a bool is no number)."""
    kind = field_type if isinstance(field_type, str) else getattr(field_type, "__name__", "")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    fits = {
        "bool": isinstance(value, bool),
        "int": number and isinstance(value, int),
        "float": number,
        "str": isinstance(value, str),
    }
    if not fits.get(kind, True):
        raise ValueError(f"{key} expects a {kind}, got {value!r}")
    return float(value) if kind == "float" else value


def resolve_alias(key: str) -> str | None:
    """The ``section.key`` an old flat key maps to (None: not an old key)."""
    return ALIASES.get(key)


def format_config(cfg: TrainConfig) -> str:
    """``--print-config``: the config as TOML, one table per section, which
    ``--config`` reads back (`freescale.pipeline.config_file`)."""
    from freescale.pipeline.config_file import config_toml

    return config_toml(cfg)
