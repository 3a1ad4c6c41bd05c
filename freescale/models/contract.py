"""The model contract: everything FreeScale's trainer reads from a model.

A model is an ``nn.Module`` written for one device. Subclassing `RecModel`
is optional (the trainer duck-types), but it documents the contract and
supplies the defaults:

- built by a *factory* from the data's description:
  ``factory(schema: DataSchema, **options) -> nn.Module``, named on the
  command line (``--set model=package.module:factory``, options as
  ``--set model.KEY=VALUE``) or passed in Python (`freescale.api.train`);
- ``forward(batch: SampleBatch) -> Tensor``: one logit per candidate,
  aligned with ``batch.labels``;
- ``sharded_modules``: paths of the ``nn.Embedding`` / TorchRec
  ``EmbeddingCollection`` modules to shard row-wise over the ranks (the
  trainer swaps them for sharded drop-ins, `freescale.embedding.swap`);
- ``embedding_inputs(batch) -> {path: input}``: what ``forward`` will pass
  to each of those modules for ``batch`` (ids, a `JaggedTensor`, a KJT).
  The trainer looks every table of a step up in *one* exchange from these
  (and a step ahead, for the sdd prefetch and prioritized updates); the
  module calls inside ``forward`` are then answered from it, so a model may
  call its tables separately, in any order, once each per step;
- ``loss(logits, batch, normalizer) -> (loss, loss_sum)``: the loss to
  minimize, a *sum* over this rank's candidates divided by ``normalizer``
  (the step's global candidate count, so moving samples between ranks never
  changes the math), and that sum detached (for the logged loss). Default:
  binary cross-entropy, or with ``objective = "softmax"`` (`RecModel`) a
  sampled softmax over each sample's candidates (`loss.softmax_loss_and_sum`);
- optional ``flops(batch) -> float``: FLOPs of a training step on ``batch``
  (forward + backward), for the step metrics' TFLOP/s and MFU. The trainer
  counts it on the host (loader workers; for balanced batches, a batch of the
  same sizes whose values are zero), so it must depend on the sizes only;
- optional ``block_stack``: the path of a `freescale.models.blocks.BlockStack`
  submodule, the model's capturable region: the pipeline may replace it with
  one running the same blocks another way (replayed captures), from outside;
- optional ``compile_regions``: paths of submodules that ``dense.compile=true``
  compiles, each in place with its own ``nn.Module.compile`` (a path naming an
  ``nn.ModuleList`` compiles each of its children: one region per block, so
  identical blocks share one compiled code). Parameters, state dict and module
  tree stay as they are. A region's calls dynamo cannot trace without
  specializing on the batch (per-sample loops, host-side layouts, opaque
  kernels) are the model's to mark: a region module may override ``compile``
  to swap such a call for its ``torch.compiler.disable``-d twin first (the
  built-in `blocks.Block` does so for its attention).

What the techniques need: load balancing moves whole samples between ranks,
so ``forward`` must treat samples independently (no batch norm across
samples); bit-identical modes need nothing more.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from freescale.jagged.batch import SampleBatch
from freescale.models.loss import bce_loss_and_sum, softmax_loss_and_sum


class RecModel(nn.Module):
    """Base class of the contract above (optional; see the module docstring)."""

    sharded_modules: tuple[str, ...] = ()
    block_stack: str | None = None  # path of a BlockStack submodule (optional)
    compile_regions: tuple[str, ...] = ()  # submodules `dense.compile` compiles (optional)
    objective: str = "bce"  # the default loss: bce | softmax (`OBJECTIVES`)

    def embedding_inputs(self, batch: SampleBatch) -> dict[str, Any]:
        """``{module path: the input forward passes it}`` for every sharded module."""
        raise NotImplementedError(f"{type(self).__name__} must define embedding_inputs(batch)")

    def loss(self, logits: Tensor, batch: SampleBatch, normalizer: Any) -> tuple[Tensor, Tensor]:
        """(Σ loss over candidates / ``normalizer``, the detached sum): ``objective``'s."""
        if self.objective == "softmax":
            max_candidates = batch.max_lengths[1] if batch.max_lengths else None
            offsets = batch.candidates.offsets
            return softmax_loss_and_sum(logits, batch.labels, offsets, normalizer, max_candidates)
        return bce_loss_and_sum(logits, batch.labels, normalizer)

    def flops(self, batch: SampleBatch) -> float | None:
        """FLOPs of one training step on ``batch`` (None: not known)."""
        return None


def has_default_loss(model: nn.Module) -> bool:
    """Whether ``model``'s loss is binary cross-entropy, the contract's default."""
    loss = getattr(type(model), "loss", None)
    return loss is None or (loss is RecModel.loss and getattr(model, "objective", "bce") == "bce")


OBJECTIVES = ("bce", "softmax")


def check_objective(objective: str) -> None:
    if objective not in OBJECTIVES:
        raise ValueError(f"model loss must be one of {', '.join(OBJECTIVES)}; got {objective!r}")


def load_object(spec: str, what: str) -> Callable[..., Any]:
    """``package.module:name`` -> that object (a factory); one-line ValueError otherwise.

    Importing runs the module's code: name only code you trust (docs/security.md).
    """
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{what}={spec!r} must look like package.module:factory")
    if os.getcwd() not in sys.path:  # as `python -m` and uvicorn do: the user's own code
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(
            f"{what}={spec!r}: cannot import {module_name!r} ({e}){_where(e, module_name)}"
        ) from None
    obj = getattr(module, name, None)
    if obj is None or not callable(obj):
        raise ValueError(f"{what}={spec!r}: {module_name} has no callable {name!r}")
    return obj


def _where(error: ImportError, module_name: str) -> str:
    """Where Python looked for ``module_name`` when it (or its package) is not
    found (the usual cause: a run started from another directory)."""
    missing = getattr(error, "name", None) or ""
    found = not (module_name + ".").startswith(missing + ".")
    if not isinstance(error, ModuleNotFoundError) or not missing or found:
        return ""  # found, but its own imports failed: the error says which
    path = os.environ.get("PYTHONPATH") or "unset"
    return (
        f"; Python looked in the working directory {os.getcwd()}, PYTHONPATH ({path}) and "
        f"the installed packages: run from the directory that holds {missing}.py (or "
        f"{missing}/), or add that directory to PYTHONPATH"
    )


def check_model(model: Any, where: str) -> None:
    """One-line ValueError if ``model`` misses a required part of the contract."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"{where} returned {type(model).__name__}, not a torch.nn.Module")
    paths = getattr(model, "sharded_modules", None)
    if not isinstance(paths, (tuple, list)) or not all(isinstance(p, str) for p in paths):
        raise ValueError(f"{where}: the model needs sharded_modules, a tuple of module paths")
    if not callable(getattr(model, "embedding_inputs", None)):
        raise ValueError(f"{where}: the model needs embedding_inputs(batch) -> {{path: input}}")
    names = dict(model.named_modules())
    for path in paths:
        if path not in names:
            raise ValueError(f"{where}: sharded module {path!r} is not a submodule of the model")
