"""Train from Python: `train` takes a model, data and settings, and gives back
the run's summary, its per-step metrics and, on request, the trained weights.

    import freescale
    from examples.categories import build, data

    result = freescale.train(
        model=build, data=data(), run={"steps": 100, "nproc": 2, "mode": "freescale"}
    )
    result.summary["ne"], result.steps[-1]["loss"]
    plain = build(data().schema)
    plain.load_state_dict(freescale.train(model=build, data=data(), state_dict=True).state_dict)

Where the ranks run:

- under ``torchrun`` this process is one rank: every rank calls `train` alike
  and rank 0 gets the result (the others get None);
- otherwise, at ``run={"nproc": 1}`` the run happens in this process (a notebook's
  models and data work as they are); at ``nproc > 1`` the ranks are spawned
  processes, so ``model`` and ``data`` must be picklable: a factory or a
  class defined in an importable module, not in ``__main__``.

``model``: an ``nn.Module`` or a factory ``factory(schema, **options)``
(`freescale.models.contract`); ``data``: a `DataSource`. Either replaces the
config's ``model.factory`` / ``data.source`` (the config then names the
object's ``module:qualname``, and ``model={...}`` holds its options only).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from torch import Tensor

from freescale.config import BUILTIN_MODEL, SECTIONS, SHORTHANDS, TrainConfig, build_config
from freescale.config.builder import unknown_key
from freescale.naming import name_of_callable, python_name


@dataclass
class TrainResult:
    """What a run gives back (on rank 0)."""

    summary: dict[str, Any]  # the JSON summary line of `freescale train`
    steps: list[dict[str, Any]]  # one metrics record per step (the metrics_path lines)
    # ``state_dict=True``: the plain (unsharded) model's full state dict:
    # ``plain_model.load_state_dict(result.state_dict)`` with the factory's model
    state_dict: dict[str, Tensor] | None = None


def train(
    model: Any = None,
    data: Any = None,
    *,
    config: TrainConfig | str | os.PathLike | None = None,
    preset: str = "demo",
    state_dict: bool = False,
    **settings: Any,
) -> TrainResult | None:
    """Train; the result on rank 0 (None on the other ranks under torchrun).

    ``settings`` are config sections as dicts of typed values
    (``run={"steps": 100, "mode": "freescale"}``, ``model={"dim": 64}``: a
    model section's keys other than ``factory`` are the factory's options),
    applied to ``config`` or to the ``preset``; a bad key or value is a
    one-line ValueError before anything starts. ``config``: a `TrainConfig` or a
    TOML file (`freescale.config.files`, read onto ``preset``).
    ``balance``: a partitioner's name or the partitioner itself, a function
    ``partition(world, runtime) -> Plan`` defined at a module's top level
    (the config then names its ``module:qualname``, docs/balance.md).
    """
    from freescale.config.files import load_config
    from freescale.run.launch import launch
    from freescale.run.run_dir import in_run_dir

    if config is None:
        cfg = build_config(preset)
    elif isinstance(config, TrainConfig):
        cfg = config
    else:
        cfg = load_config(config, preset)
    if model is not None:  # its name in the config (and manifests); options its own
        section = settings.get("model")
        given = dict(section) if isinstance(section, dict) else {}
        settings = {**settings, "model": {"factory": python_name(model), **given}}
    cfg = in_run_dir(with_settings(cfg, settings))
    out = launch(cfg, model=model, data=data, state_dict=state_dict)
    if out is None:
        return None
    return TrainResult(out["summary"], out["steps"], out.get("state_dict"))


def with_settings(cfg: TrainConfig, settings: dict[str, Any]) -> TrainConfig:
    """``cfg`` with sections given as dicts (``data``, ``model`` and ``balance``
    also as a name) applied; ``eval_only=True``: restore ``checkpoint.resume``
    and evaluate, no training."""
    settings = dict(settings)
    values = cfg.as_dict()
    eval_only = bool(settings.pop("eval_only", cfg.eval_only)) if settings else cfg.eval_only
    base_factory = cfg.model.factory
    model_options: dict[str, Any] = {}
    for key, value in settings.items():
        if key in SECTIONS and isinstance(value, dict):
            for name, v in value.items():
                _put(values, key, name, v, model_options)
        elif key in SHORTHANDS and (isinstance(value, str) or key == "balance"):
            section, _, name = SHORTHANDS[key].partition(".")
            _put(values, section, name, value, model_options)
        else:
            raise ValueError(unknown_key(key, "give sections as dicts (run={...})"))
    if values["model"]["factory"] != base_factory:
        values["model"]["options"] = model_options  # the preset's were the built-in's
    if not values["model"]["factory"]:
        values["model"]["factory"] = BUILTIN_MODEL
    try:
        built = TrainConfig.from_dict(values)
    except TypeError as e:  # an unknown key of a section
        raise ValueError(f"unknown config key: {e}") from None
    return replace(built, eval_only=eval_only)


def _put(values: dict, section: str, name: str, value: Any, model_options: dict) -> None:
    fields = values[section]
    if (section, name) == ("balance", "method") and callable(value):
        value = name_of_callable(value, "balance")  # a spawned rank imports it by name
    if section in ("data", "model") and name not in fields:
        fields["options"] = {**fields["options"], name: value}
        if section == "model":
            model_options[name] = value
    else:
        fields[name] = value
