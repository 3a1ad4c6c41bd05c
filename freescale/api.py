"""Train from Python: `train` takes a model, data and settings, and gives back
the run's summary, its per-step metrics and, on request, the trained weights.

    import freescale
    from examples.categories import build, data

    result = freescale.train(model=build, data=data(), steps=100, nproc=2, mode="freescale")
    result.summary["ne"], result.steps[-1]["loss"]
    plain = build(data().schema)
    plain.load_state_dict(freescale.train(model=build, data=data(), state_dict=True).state_dict)

Where the ranks run:

- under ``torchrun`` this process is one rank: every rank calls `train` alike
  and rank 0 gets the result (the others get None);
- otherwise, at ``nproc=1`` the run happens in this process (a notebook's
  models and data work as they are); at ``nproc > 1`` the ranks are spawned
  processes, so ``model`` and ``data`` must be picklable: a factory or a
  class defined in an importable module, not in ``__main__``.

``model``: an ``nn.Module`` or a factory ``factory(schema, **options)``
(`freescale.models.contract`); ``data``: a `DataSource`. Either replaces the
config's ``model`` / ``data`` strings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from freescale.pipeline.config import TrainConfig, build_config


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
    config: TrainConfig | None = None,
    preset: str = "demo",
    state_dict: bool = False,
    **settings: Any,
) -> TrainResult | None:
    """Train; the result on rank 0 (None on the other ranks under torchrun).

    ``settings`` are config keys with typed values (``steps=100``,
    ``mode="freescale"``, ``model_options={"dim": 64}``), applied to
    ``config`` or to the ``preset``; a bad key or value is a one-line
    ValueError before anything starts.
    """
    from freescale.pipeline.launch import launch

    cfg = config if config is not None else build_config(preset)
    known = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise ValueError(f"unknown config keys {unknown}; see `freescale train --print-config`")
    cfg = dataclasses.replace(cfg, **settings)
    out = launch(cfg, model=model, data=data, state_dict=state_dict)
    if out is None:
        return None
    return TrainResult(out["summary"], out["steps"], out.get("state_dict"))
