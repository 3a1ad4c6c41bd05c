"""The in-backward sparse update, seen as a ``torch.optim.Optimizer``.

`FusedOptimizer(collection)` gives the update a handle in the usual shape:
one param group per store (tables sharing dtype, dim and optimizer), its
values live (``lr``, ``weight_decay``, ``eps``, ``betas``: an LR scheduler's
or a user's changes apply from the next backward), and
``state_dict()`` / ``load_state_dict()`` carrying the hyperparameters and the
per-table optimizer state (in logical row order, see `state_dict.py`).
``step()`` and ``zero_grad()`` do nothing: the update already ran in backward.

`from_fused_params` maps TorchRec's ``fused_params`` dict onto our configs;
`set_gradient_division` divides the embedding gradients by the world size,
as TorchRec does by default (``set_gradient_division(True)``), for runs that
must match TorchRec's numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from freescale.embedding.collection import ShardedEmbeddingCollection
from freescale.embedding.optim import SGD, Adam, OptimizerConfig, RowwiseAdagrad
from freescale.embedding.state.state_dict import load_tables, save_tables
from freescale.jagged import JaggedTensor

# TorchRec / FBGEMM optimizer names (``EmbOptimType``) we implement exactly.
_TYPES: dict[str, type] = {
    "sgd": SGD,
    "exact_sgd": SGD,
    "row_wise_adagrad": RowwiseAdagrad,
    "exact_row_wise_adagrad": RowwiseAdagrad,
    "adam": Adam,
}
# Keys that change how tables are stored or cached, not the update's math.
_STORAGE_KEYS = {"output_dtype", "cache_load_factor", "cache_precision", "prefetch_pipeline"}


_DECAY_MODES = ("NONE", "L2", "DECOUPLE", "COUNTER", "COWCLIP", "DECOUPLE_GLOBAL")


def _decay_mode_name(mode: Any) -> str:
    """``WeightDecayMode`` member, its name or its value -> the name."""
    if isinstance(mode, int):
        return _DECAY_MODES[mode] if 0 <= mode < len(_DECAY_MODES) else str(mode)
    return str(getattr(mode, "name", mode)).upper()


def _weight_decay(name: str, decay: float, mode: str) -> dict[str, Any]:
    """Our decay fields for FBGEMM's ``weight_decay`` / ``weight_decay_mode`` of ``name``."""
    if decay == 0.0:
        return {}
    cls = _TYPES[name]
    if cls is SGD:
        raise ValueError(f"fused_params: key 'weight_decay' does not apply to {name!r}")
    if mode not in ("NONE", "L2", "DECOUPLE"):
        raise ValueError(f"fused_params: key 'weight_decay_mode' = {mode} is not supported")
    if cls is Adam:  # FBGEMM's Adam decays decoupled whatever the mode says
        if mode == "L2":
            raise ValueError(
                "fused_params: key 'weight_decay_mode' = L2 with 'adam': FBGEMM's Adam "
                "decays decoupled; use DECOUPLE"
            )
        return {"weight_decay": decay}
    if mode == "NONE":  # FBGEMM's row-wise Adagrad would silently not decay
        raise ValueError(
            f"fused_params: key 'weight_decay' = {decay} with weight_decay_mode NONE "
            "has no effect in FBGEMM; set weight_decay_mode to L2 or DECOUPLE"
        )
    return {"weight_decay": decay, "weight_decay_mode": "l2" if mode == "L2" else "decoupled"}


def from_fused_params(fused_params: Mapping[str, Any]) -> OptimizerConfig:
    """The optimizer config of TorchRec's ``fused_params``.

    Reads ``optimizer`` (an ``EmbOptimType`` or its name), ``learning_rate``,
    ``eps``, ``beta1``, ``beta2``, ``weight_decay`` and ``weight_decay_mode``
    (a ``WeightDecayMode``, its name or value). Raises ValueError, naming the
    key, for anything we would not reproduce exactly (another optimizer, a
    decay FBGEMM would not apply, an unknown key).
    """
    params = dict(fused_params)
    kind = params.pop("optimizer", None)
    if kind is None:
        raise ValueError("fused_params: key 'optimizer' is required")
    name = str(getattr(kind, "value", kind)).lower()
    if name not in _TYPES:
        raise ValueError(f"fused_params: optimizer {name!r} is not one of {sorted(_TYPES)}")
    cls = _TYPES[name]
    kwargs: dict[str, Any] = {}
    if "learning_rate" in params:
        kwargs["lr"] = float(params.pop("learning_rate"))
    for key, field in (("eps", "eps"), ("beta1", "beta1"), ("beta2", "beta2")):
        if key in params:
            value = params.pop(key)
            if field not in {f.name for f in dataclasses.fields(cls)}:
                raise ValueError(f"fused_params: key {key!r} does not apply to {name!r}")
            kwargs[field] = float(value)
    decay = float(params.pop("weight_decay", 0.0))
    mode = _decay_mode_name(params.pop("weight_decay_mode", "NONE"))
    kwargs.update(_weight_decay(name, decay, mode))
    unknown = sorted(k for k in params if k not in _STORAGE_KEYS)
    if unknown:
        raise ValueError(f"fused_params: key {unknown[0]!r} is not supported")
    return cls(**kwargs)


class _LiveGroup:
    """A param group as a store's ``lr_schedule``: the update reads the live
    ``lr`` through it and, through `configure`, the group's other values."""

    def __init__(self, group: dict) -> None:
        self.group = group

    def __call__(self, step: int) -> float:
        return float(self.group["lr"])

    def configure(self, opt: OptimizerConfig) -> OptimizerConfig:
        """``opt`` with the group's weight decay, eps and betas (``opt`` itself
        when they are unchanged; a bad value raises the config's ValueError)."""
        g, changes = self.group, {}
        for key in ("weight_decay", "eps"):
            if key in g:
                changes[key] = float(g[key])
        if "betas" in g:
            changes["beta1"], changes["beta2"] = (float(b) for b in g["betas"])
        if all(getattr(opt, k) == v for k, v in changes.items()):
            return opt
        return dataclasses.replace(opt, **changes)


def _hyper(opt: OptimizerConfig) -> dict[str, Any]:
    out: dict[str, Any] = {"lr": opt.lr, "weight_decay": opt.weight_decay}
    if isinstance(opt, RowwiseAdagrad | Adam):
        out["eps"] = opt.eps
    if isinstance(opt, Adam):
        out["betas"] = (opt.beta1, opt.beta2)
    return out


class FusedOptimizer(Optimizer):
    """Param groups, LR scheduling and state dicts of a collection's fused update."""

    def __init__(self, collection: ShardedEmbeddingCollection) -> None:
        self.collection = collection
        groups = []
        for store in collection.stores:
            opt = store.optimizer
            if opt.lr_schedule is not None and not isinstance(opt.lr_schedule, _LiveGroup):
                raise ValueError(
                    f"tables {[t.name for t in store.tables]} have an lr_schedule; "
                    "drive the lr either with it or with a scheduler on FusedOptimizer"
                )
            hyper = _hyper(opt)
            if isinstance(opt.lr_schedule, _LiveGroup):  # an earlier FusedOptimizer's
                hyper.update({k: v for k, v in opt.lr_schedule.group.items() if k in hyper})
            tables = [t.name for t in store.tables]
            groups.append({"params": [store.weight], "tables": tables, **hyper})
        super().__init__(groups, defaults={})
        for store, group in zip(collection.stores, self.param_groups, strict=True):
            live = _LiveGroup(group)
            store.optimizer = dataclasses.replace(store.optimizer, lr_schedule=live)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Nothing to do: the update ran in backward. Returns ``closure()`` if given."""
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the fused update keeps no gradients."""

    def _tables(self) -> dict[str, str]:
        return {t: t for group in self.param_groups for t in group["tables"]}

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """``{"state": {table.optimizer.<name>: tensor}, "param_groups": [...]}`` (collective)."""
        state: dict[str, Tensor] = {}
        save_tables(self.collection, self._tables(), "", state, weights=False)
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:  # type: ignore[override]
        saved = state_dict["param_groups"]
        mine = [g["tables"] for g in self.param_groups]
        theirs = [g["tables"] for g in saved]
        if theirs != mine:
            raise ValueError(f"optimizer state of tables {theirs}, not {mine}")
        for group, src in zip(self.param_groups, saved, strict=True):
            group.update({k: v for k, v in src.items() if k not in ("params", "tables")})
        missing: list[str] = []
        unexpected: list[str] = []
        errors: list[str] = []
        args = ({}, True, missing, unexpected, errors)
        load_tables(self.collection, self._tables(), "", state_dict["state"], *args, weights=False)
        if missing or unexpected or errors:
            raise ValueError(
                f"optimizer state mismatch: missing {missing}, unexpected {unexpected}, {errors}"
            )


# ---- gradient division ----------------------------------------------------------
class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, scale: float) -> Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g * ctx.scale, None


def _divide_outputs(module: ShardedEmbeddingCollection, args: Any, outputs: Any) -> Any:
    scale = 1.0 / module.comm.world_size
    out = {}
    for key, value in outputs.items():
        if isinstance(value, JaggedTensor):
            value = JaggedTensor(_ScaleGrad.apply(value.values, scale), value.offsets)
        elif isinstance(value, Tensor):
            value = _ScaleGrad.apply(value, scale)
        # TorchRec outputs of a KJT call wrap the inner call's, already scaled.
        out[key] = value
    return out


def set_gradient_division(collection: ShardedEmbeddingCollection, enabled: bool) -> None:
    """Divide every embedding gradient by the world size (TorchRec's default) or not (ours)."""
    handle = collection.__dict__.pop("_gradient_division", None)
    if handle is not None:
        handle.remove()
    if enabled:
        collection.__dict__["_gradient_division"] = collection.register_forward_hook(
            _divide_outputs
        )
