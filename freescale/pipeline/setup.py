"""Building the pieces of a training run, each from its config section (one rank)."""

from __future__ import annotations

import difflib
import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from freescale.config import DataSection, ModelSection, RunSection, TrainConfig
from freescale.data.source import BUILTIN_KINDS, DataSource, open_source, schema_of
from freescale.jagged.schema import DataSchema
from freescale.models.contract import check_model, load_object


def pick_device(run: RunSection) -> torch.device:
    want = run.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device=cuda but no CUDA device is visible")
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(run: RunSection) -> None:
    """Same seed on every rank: replicated dense weights start identical."""
    random.seed(run.seed)
    np.random.seed(run.seed)
    torch.manual_seed(run.seed)
    if run.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def make_source(data: DataSection | TrainConfig, seed: int = 0) -> DataSource:
    """The run's data source, from its section (``seed``: the run's; a whole
    config gives both, and whether the item ids stay raw: `TrainConfig.raw_item_ids`)."""
    raw = data.raw_item_ids() if isinstance(data, TrainConfig) else data.raw_ids == "on"
    if isinstance(data, TrainConfig):
        data, seed = data.data, data.run.seed
    kind = data.source.partition(":")[0]
    if kind not in BUILTIN_KINDS:  # package.module:factory
        try:
            factory = load_object(data.source, "data")
        except ValueError as e:  # a misspelt format reads as a module that does not import
            raise ValueError(_not_a_format(data.source, kind, str(e))) from None
        source = factory(**data.options)
        if not callable(getattr(source, "batch", None)):
            raise ValueError(
                f"data={data.source!r} returned {type(source).__name__}, no DataSource"
            )
        return source
    synthetic, sampling = data.synthetic_configs(seed)
    return open_source(data.source, synthetic, sampling, data.options, data.ids, raw)


def _not_a_format(source: str, kind: str, import_error: str) -> str:
    formats = f"built-in formats: {', '.join(BUILTIN_KINDS)}"
    close = difflib.get_close_matches(kind, BUILTIN_KINDS, n=1, cutoff=0.75)
    if close:
        return (
            f"data={source!r}: {kind!r} is no data format; did you mean {close[0]!r}? ({formats})"
        )
    return f"{import_error} ({formats}, else package.module:factory)"


def check_data(cfg: TrainConfig, world_size: int, source: DataSource | None = None) -> DataSource:
    """Fail at start, in the launching process, if the data cannot feed the run.

    ``source``: a `DataSource` object given in Python instead of ``data.source``."""
    data, run = cfg.data, cfg.run
    source = make_source(cfg) if source is None else source
    schema_of(source)  # a malformed schema fails here
    name, batch_size = data.source, run.batch_size
    if run.epochs:
        epoch_steps(run, source, world_size)  # run.epochs without file data: one line here
    check_world = getattr(source, "check_world", None)  # streamed data: a share per rank
    if check_world is not None:
        check_world(world_size, batch_size)
    if hasattr(source, "steps_per_epoch"):  # file data: epochs repeat, any step count
        counts = source.split_counts()
        if source.steps_per_epoch(world_size, batch_size) < 1:
            raise ValueError(
                f"{name}: {counts['train_samples']} training samples (from "
                f"{counts['users']} users, {counts['users_dropped']} too short) do not fill one "
                f"global batch of world size {world_size} x batch_size {batch_size}"
            )
        return source
    available = source.num_steps(world_size, batch_size)
    if available is None:
        return source
    total = available * world_size * batch_size
    samples = len(source) if hasattr(source, "__len__") else total
    if samples < world_size:
        raise ValueError(f"more ranks ({world_size}) than samples ({samples}) in {name}")
    if available < run.steps:
        raise ValueError(
            f"{name} has {samples} samples = {available} global batches of "
            f"{world_size}x{batch_size}; steps={run.steps} needs {run.steps}"
        )
    return source


def epoch_steps(run: RunSection, source: Any, world_size: int) -> int:
    """The steps of ``run.epochs`` passes over ``source``'s training samples
    (whole global batches); a one-line ValueError where there are none."""
    per_epoch = getattr(source, "steps_per_epoch", None)
    if per_epoch is None:
        raise ValueError("run.epochs needs file data (data=sasrec:PATH, ...): set run.steps")
    return run.epochs * per_epoch(world_size, run.batch_size)


def open_data(
    cfg: TrainConfig, world_size: int, source: DataSource | None = None
) -> tuple[TrainConfig, DataSource]:
    """The run's data (`check_data`) and ``cfg`` with ``run.epochs`` as its steps."""
    source = check_data(cfg, world_size, source)
    return resolve_epochs(cfg, source, world_size), source


def resolve_epochs(cfg: TrainConfig, source: Any, world_size: int) -> TrainConfig:
    """``cfg`` with ``run.steps`` set from ``run.epochs`` and ``evaluation.every``
    from ``evaluation.every_epochs`` (unchanged without them)."""
    if not cfg.run.epochs:
        return cfg
    steps = epoch_steps(cfg.run, source, world_size)
    every = steps // cfg.run.epochs * cfg.evaluation.every_epochs or cfg.evaluation.every
    try:
        cfg.check_warmups(steps)
        return cfg.with_values(run__steps=steps, evaluation__every=every)
    except ValueError as e:
        raise ValueError(f"run.epochs={cfg.run.epochs} is {steps} steps: {e}") from None


def build_model(section: ModelSection, schema: DataSchema, model: Any = None) -> nn.Module:
    """The run's model: ``model`` (an ``nn.Module`` or a factory) when given,
    else the section's factory (the built-in sequence model by default) with
    its options; table sizes come from the data's ``schema``, never a default."""
    where, given = "the model", model is not None
    if model is None:
        model, where = load_object(section.factory, "model"), f"model={section.factory}"
    # A model given in Python with the built-in factory configured: the
    # section's options are the built-in model's (the preset's), not its own.
    options = {} if given and section.builtin else section.options
    if isinstance(model, nn.Module):
        if options:
            raise ValueError("model.* options go to a model factory, not to a model object")
        built: Any = model
    else:
        try:
            built = model(schema, **options)
        except TypeError as e:
            raise ValueError(f"{where}: factory(schema, **model options) failed: {e}") from None
    check_model(built, where)
    return built


def glob_escape(path: str) -> str:
    """``path`` as a pattern matching only itself (plans take glob patterns)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)
