"""Training configuration: one flat dataclass, named presets, ``key=value`` overrides.

Flat on purpose: every knob is one ``--set key=value`` away and one line in
the JSON summary. Validation happens in ``__post_init__`` (ValueError with
one clear sentence), in the launching process, before any rank starts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields, replace
from typing import Any

from freescale.comm import BACKENDS as COMM_BACKENDS
from freescale.pipeline.faults import parse_ranks

MODES = ("sync", "sdd", "freescale")
BALANCE = ("none", "fbs", "vbs", "cost")
DEVICES = ("auto", "cpu", "cuda")
EMB_OPTIMIZERS = ("sgd", "adagrad", "adam")


@dataclass(frozen=True)
class TrainConfig:
    # run
    mode: str = "sync"
    # freescale's prioritized updates hide the exclusive rows' gradient exchange
    # and update behind the next step; at one rank there is no exchange and one
    # stream, so "auto" runs freescale there with sdd's schedule (same numbers,
    # less work); "on" keeps the split at any world size
    prioritize: str = "auto"
    balance: str = "none"  # none | fbs | vbs | cost (sequence load balancing)
    plan_process: str = "auto"  # partition in a helper process: auto (on GPUs) | on | off
    balance_counts: str = "equal"  # balance=cost: equal | variable local batch sizes
    max_local_batch: int = 0  # balance_counts=variable: per-rank cap (0: 2 x batch_size)
    nproc: int = 2
    device: str = "cpu"
    comm_backend: str = "torch"  # torch | smfree[-shm|-gloo|-hier] (docs/comm.md)
    # backend of the exchanges issued ahead of their use (balancer stage III, the
    # embedding prefetches, deferred gradients); empty: the same as comm_backend
    comm_overlapped: str = ""
    steps: int = 150
    warmup: int = 5
    batch_size: int = 32
    seed: int = 0
    deterministic: bool = True
    # data: synthetic | sasrec:PATH | movielens:PATH | parquet:PATH | csv:PATH |
    # package.module:factory (called with the data.KEY=VALUE options)
    data: str = "synthetic"
    data_options: dict[str, Any] = field(default_factory=dict)
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
    # model: empty = the built-in sequence model (dim, heads, layers, attention,
    # dense_graphs below); package.module:factory = your own, built as
    # factory(schema, **model_options) (docs/your-model.md); model.KEY=VALUE sets options
    model: str = ""
    model_options: dict[str, Any] = field(default_factory=dict)
    dim: int = 32
    item_dim: int = 32
    heads: int = 2
    layers: int = 1
    attention: str = "auto"
    amp: str = "none"  # none | bf16 (autocast of the dense model on CUDA)
    # CUDA graphs of the dense blocks, one per padded shape: far fewer host
    # launches at small batches; close to (not bitwise equal to) eager numbers
    dense_graphs: bool = False
    # inside those graphs, the candidate path on its own stream (2) or not (1):
    # same kernels, same numbers; 1 is the reference of an A/B
    dense_graph_streams: int = 2
    # optimization
    dense_lr: float = 3e-3
    emb_optimizer: str = "adagrad"
    emb_lr: float = 0.05
    assignment: str = "hashed"
    # evaluation and output
    eval_every: int = 30
    eval_batches: int = 4
    metrics_path: str = ""
    trace_path: str = ""
    trace_steps: str = ""
    progress: bool = True
    # data loading: worker processes per rank (-1: auto, 0 on CPU ranks)
    loader_workers: int = -1
    # fault injection (checks the metrics): extra compute / loader time per step
    delay_compute_ms: float = 0.0
    delay_loader_ms: float = 0.0
    delay_ranks: str = ""  # ranks affected, e.g. "1" or "0,2"; empty = all
    # print every call site where the host waits for the GPU (after warm-up)
    sync_debug: bool = False
    # reliability (freescale.pipeline.checkpoint / liveness / inputs)
    checkpoint_dir: str = ""  # where checkpoints go; empty = none
    checkpoint_every: int = 0  # steps between checkpoints (0: only on SIGTERM)
    checkpoint_keep: int = 2  # newest complete checkpoints kept
    resume: str = ""  # a checkpoint, or a checkpoint_dir (its newest); empty = start at 0
    timeout_s: float = 300.0  # collective timeout: a stuck rank fails the run after this
    # a step whose loss or gradients are not finite on some rank changes nothing on
    # any rank and is counted; "raise" fails the run after nonfinite_max_skips
    # consecutive skipped steps (0: on the first), "skip" never does
    nonfinite: str = "raise"
    nonfinite_max_skips: int = 3
    eval_only: bool = False  # `freescale eval`: restore ``resume``, evaluate, no training

    def __post_init__(self) -> None:
        _choice("mode", self.mode, MODES)
        _choice("balance", self.balance, BALANCE)
        _choice("prioritize", self.prioritize, ("auto", "on"))
        _choice("device", self.device, DEVICES)
        _choice("comm_backend", self.comm_backend, COMM_BACKENDS)
        if self.comm_overlapped:
            _choice("comm_overlapped", self.comm_overlapped, COMM_BACKENDS)
        _choice("emb_optimizer", self.emb_optimizer, EMB_OPTIMIZERS)
        _choice("assignment", self.assignment, ("hashed", "block"))
        _choice("attention", self.attention, ("auto", "reference", "varlen"))
        _choice("amp", self.amp, ("none", "bf16"))
        _choice("plan_process", self.plan_process, ("auto", "on", "off"))
        _choice("balance_counts", self.balance_counts, ("equal", "variable"))
        _choice("nonfinite", self.nonfinite, ("raise", "skip"))
        for name in ("model_options", "data_options"):
            if not isinstance(getattr(self, name), dict):
                section = name.split("_")[0]
                raise ValueError(f"{name} is set as {section}.KEY=VALUE, one key at a time")
        if self.model and ":" not in self.model:
            raise ValueError(f"model={self.model!r} must look like package.module:factory")
        if self.dense_graph_streams not in (1, 2):
            raise ValueError(f"dense_graph_streams must be 1 or 2, got {self.dense_graph_streams}")
        if self.dense_graphs and self.attention == "reference":
            raise ValueError("dense_graphs=true needs attention=auto or varlen (CUDA graphs)")
        if self.balance_counts == "variable" and self.balance != "cost":
            raise ValueError("balance_counts=variable needs balance=cost")
        if self.max_local_batch and self.max_local_batch < self.batch_size:
            raise ValueError(f"max_local_batch must be 0 or >= batch_size ({self.batch_size})")
        for name in (
            "nproc",
            "steps",
            "batch_size",
            "num_items",
            "dim",
            "item_dim",
            "heads",
            "layers",
            "max_candidates",
            "eval_batches",
            "max_uih",
            "length_cap",
            "checkpoint_keep",
            "target_stride",
            "eval_negatives",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "warmup",
            "max_content",
            "eval_every",
            "checkpoint_every",
            "nonfinite_max_skips",
            "samples_per_user",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.warmup >= self.steps:
            raise ValueError(f"warmup ({self.warmup}) must be < steps ({self.steps})")
        if self.item_dim != self.dim:
            raise ValueError(
                f"item table dim mismatch: item_dim={self.item_dim} but the model's dim is "
                f"{self.dim} (the reference model feeds item embeddings in directly)"
            )
        if self.dim % self.heads:
            raise ValueError(f"dim ({self.dim}) must be divisible by heads ({self.heads})")
        if not 0.0 <= self.step_overlap <= 1.0:
            raise ValueError(f"step_overlap must lie in [0, 1], got {self.step_overlap}")
        for name in ("dense_lr", "emb_lr", "length_median", "zipf_alpha"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.length_sigma) and self.length_sigma >= 0):
            raise ValueError(f"length_sigma must be a finite number >= 0, got {self.length_sigma}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s >= 1):
            raise ValueError(
                f"timeout_s must be a finite number of seconds >= 1, got {self.timeout_s}"
            )
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("checkpoint_every needs checkpoint_dir (where to write them)")
        if self.trace_steps:
            trace_window(self.trace_steps)
        if self.loader_workers < -1:
            raise ValueError(f"loader_workers must be -1 (auto) or >= 0, got {self.loader_workers}")
        for name in ("delay_compute_ms", "delay_loader_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        parse_ranks(self.delay_ranks)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def trace_window(text: str) -> tuple[int, int]:
    """``"10-12"`` -> (10, 12): the steps a profiler trace covers (inclusive)."""
    try:
        a, b = (int(x) for x in text.split("-"))
    except ValueError:
        raise ValueError(f"trace_steps must look like '10-12', got {text!r}") from None
    if not 0 <= a <= b:
        raise ValueError(f"trace_steps must be an increasing range, got {text!r}")
    return a, b


# GPU runs (one process per GPU): the paper's long-UIH regime, bf16 autocast.
_H200 = dict(
    device="cuda", nproc=2, steps=60, warmup=10, batch_size=64, num_items=10_000_000,
    length_median=4_500, length_sigma=0.55, length_cap=17_000, max_candidates=8,
    max_content=4, dim=256, item_dim=256, heads=4, layers=4, emb_optimizer="adagrad",
    eval_every=0, deterministic=False, amp="bf16",
)  # fmt: skip

PRESETS: dict[str, dict[str, Any]] = {
    # The README demo: 2 gloo ranks on the CPU, small model, long-tail data.
    "demo": {},
    "h200-8k": {**_H200, "max_uih": 8_000},
    "h200-21k": {**_H200, "max_uih": 21_000},
}


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


_OPTION_SECTIONS = {"model.": "model_options", "data.": "data_options"}


def build_config(preset: str = "demo", overrides: list[str] | None = None) -> TrainConfig:
    """A preset with ``key=value`` overrides applied; unknown keys are errors.

    ``model.KEY=VALUE`` / ``data.KEY=VALUE`` become options of the model /
    data factory (JSON literals, else strings)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
    types = {f.name: f.type for f in fields(TrainConfig)}
    values = dict(PRESETS[preset])
    for item in overrides or []:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep:
            raise ValueError(f"override {item!r} must look like key=value")
        section = next((v for k, v in _OPTION_SECTIONS.items() if key.startswith(k)), None)
        if section is not None and key.split(".", 1)[1]:
            name = key.split(".", 1)[1]
            values[section] = {**values.get(section, {}), name: option_value(text.strip())}
            continue
        if key not in types:
            raise ValueError(f"unknown config key {key!r}; known keys: {', '.join(types)}")
        values[key] = parse_value(types[key], key, text.strip())
    return replace(TrainConfig(), **values)
