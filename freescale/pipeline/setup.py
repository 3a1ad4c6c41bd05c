"""Building the pieces of a training run from a `TrainConfig` (one rank)."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from freescale.data.distributions import LengthDistribution
from freescale.data.sequences import SequenceSampling
from freescale.data.source import BUILTIN_KINDS, DataSource, open_source, schema_of
from freescale.data.synthetic import SyntheticConfig
from freescale.embedding import SGD, Adam, RowwiseAdagrad, ShardingPlan
from freescale.embedding.optim import OptimizerConfig
from freescale.jagged.schema import DataSchema
from freescale.models import sequence
from freescale.models.contract import check_model, load_object
from freescale.pipeline.config import TrainConfig


def pick_device(cfg: TrainConfig) -> torch.device:
    want = cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device=cuda but no CUDA device is visible")
        local = int(os.environ.get("LOCAL_RANK", dist.get_rank() if dist.is_initialized() else 0))
        torch.cuda.set_device(local % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def seed_everything(cfg: TrainConfig) -> None:
    """Same seed on every rank: replicated dense weights start identical."""
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)


def make_source(cfg: TrainConfig) -> DataSource:
    kind = cfg.data.partition(":")[0]
    if kind not in BUILTIN_KINDS:  # package.module:factory
        source = load_object(cfg.data, "data")(**cfg.data_options)
        if not callable(getattr(source, "batch", None)):
            raise ValueError(f"data={cfg.data!r} returned {type(source).__name__}, no DataSource")
        return source
    synthetic = SyntheticConfig(
        num_items=cfg.num_items,
        zipf_alpha=cfg.zipf_alpha,
        max_uih=cfg.max_uih,
        lengths=LengthDistribution(
            median=cfg.length_median, sigma=cfg.length_sigma, cap=cfg.length_cap
        ),
        max_candidates=cfg.max_candidates,
        max_content=cfg.max_content,
        seed=cfg.seed,
        step_overlap=cfg.step_overlap,
    )
    sampling = SequenceSampling(
        max_uih=cfg.max_uih,
        samples_per_user=cfg.samples_per_user,
        stride=cfg.target_stride,
        shuffle=cfg.shuffle,
        eval_negatives=cfg.eval_negatives,
        seed=cfg.seed,
    )
    return open_source(cfg.data, synthetic, sampling, cfg.data_options)


def check_data(cfg: TrainConfig, world_size: int, source: DataSource | None = None) -> DataSource:
    """Fail at start, in the launching process, if the data cannot feed the run.

    ``source``: a `DataSource` object given in Python instead of ``cfg.data``."""
    source = make_source(cfg) if source is None else source
    schema_of(source)  # a malformed schema fails here
    if hasattr(source, "steps_per_epoch"):  # file data: epochs repeat, any step count
        counts = source.split_counts()
        if source.steps_per_epoch(world_size, cfg.batch_size) < 1:
            raise ValueError(
                f"{cfg.data}: {counts['train_samples']} training samples (from "
                f"{counts['users']} users, {counts['users_dropped']} too short) do not fill one "
                f"global batch of world size {world_size} x batch_size {cfg.batch_size}"
            )
        return source
    available = source.num_steps(world_size, cfg.batch_size)
    if available is None:
        return source
    total = available * world_size * cfg.batch_size
    samples = len(source) if hasattr(source, "__len__") else total
    if samples < world_size:
        raise ValueError(f"more ranks ({world_size}) than samples ({samples}) in {cfg.data}")
    if available < cfg.steps:
        raise ValueError(
            f"{cfg.data} has {samples} samples = {available} global batches of "
            f"{world_size}x{cfg.batch_size}; steps={cfg.steps} needs {cfg.steps}"
        )
    return source


def build_model(cfg: TrainConfig, schema: DataSchema, model: Any = None) -> nn.Module:
    """The run's model: ``model`` (an ``nn.Module`` or a factory) when given,
    else ``cfg.model``'s factory, else the built-in sequence model; table
    sizes come from the data's ``schema``, never a default."""
    where = "the model"
    if model is None and cfg.model:
        model, where = load_object(cfg.model, "model"), f"model={cfg.model}"
    if model is None:
        built: Any = sequence.build(
            schema,
            **{
                "dim": cfg.dim,
                "heads": cfg.heads,
                "layers": cfg.layers,
                "attention": cfg.attention,
                "graphs": cfg.dense_graphs,
                "graph_streams": cfg.dense_graph_streams,
                **cfg.model_options,
            },
        )
    elif isinstance(model, nn.Module):
        if cfg.model_options:
            raise ValueError("model.* options go to a model factory, not to a model object")
        built = model
    else:
        try:
            built = model(schema, **cfg.model_options)
        except TypeError as e:
            raise ValueError(f"{where}: factory(schema, **model options) failed: {e}") from None
    check_model(built, where)
    return built


def embedding_optimizer(cfg: TrainConfig) -> OptimizerConfig:
    if cfg.emb_optimizer == "sgd":
        return SGD(lr=cfg.emb_lr)
    if cfg.emb_optimizer == "adagrad":
        return RowwiseAdagrad(lr=cfg.emb_lr)
    return Adam(lr=cfg.emb_lr)


def sharding_plan(cfg: TrainConfig, model: nn.Module) -> ShardingPlan:
    """Row-wise shard exactly the modules the model names (`sharded_modules`)."""
    modules = tuple(model.sharded_modules)  # type: ignore[attr-defined]
    return ShardingPlan(
        optimizer=embedding_optimizer(cfg),
        assignment=cfg.assignment,
        modules=tuple(glob_escape(p) for p in modules),
    )


def glob_escape(path: str) -> str:
    """``path`` as a pattern matching only itself (plans take glob patterns)."""
    return "".join(f"[{c}]" if c in "*?[" else c for c in path)


class DenseSync:
    """DDP over the dense parameters with a *sum* all-reduce.

    DDP averages gradients (divides by W); our loss is already normalized by
    the global candidate count, so the right reduction is a plain sum. The
    hook also marks when the last bucket became ready: from there to the end
    of backward is the dense all-reduce time the compute stream is exposed to.
    On one rank there is nothing to reduce: ``ddp`` is the model itself.
    """

    def __init__(self, model: nn.Module, mark) -> None:
        self.mark = mark
        self.last_ready: tuple[int, object] | None = None
        self.model = model
        if dist.get_world_size() == 1:
            # One rank: the sum all-reduce is the identity. DDP would copy every
            # gradient into its bucket (a kernel per parameter) and run its
            # forward hooks on the host, for the same numbers.
            self.ddp: nn.Module = model
            graphs = getattr(model, "graphs", None)
            if graphs is not None:  # no DDP hook to feed: the graphs set `.grad` themselves
                graphs.own_grads = True
            return
        # The sharded tables live outside the module tree, so DDP sees only
        # dense parameters (and the model has no buffers to broadcast).
        # Gradients as views of the all-reduce buckets: the reduced buckets are
        # the gradients, no copy back per parameter after backward (same values).
        self.ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        self.ddp.register_comm_hook(self, DenseSync._hook)

    def cover_all(self, loss: Tensor) -> Tensor:
        """``loss`` + 0 x one element of every dense parameter.

        With an empty local batch (or no UIH tokens, or no candidates) some
        parameters get no gradient at all on this rank; DDP would then never
        reduce their bucket here while the other ranks do, and the ranks'
        collectives would pair up wrongly (a hang). The zero term gives every
        parameter a (zero) gradient and changes no value.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        return loss + sum(p.reshape(-1)[:1].sum() for p in params) * 0.0

    @staticmethod
    def _hook(state, bucket):
        state.last_ready = state.mark()
        fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
