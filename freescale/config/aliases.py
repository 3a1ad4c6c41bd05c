"""The old flat keys of the single-dataclass config, kept for one release.

`ALIASES` maps each to its ``section.key``; `nested_from_flat` reads an old
flat manifest. Each use of an old key is reported once (`notice_text`).
"""

from __future__ import annotations

import warnings
from dataclasses import fields
from typing import Any

from freescale.config.sections import (
    BUILTIN_MODEL,
    SECTIONS,
    DataSection,
    FaultsSection,
    OutputSection,
    PipelineSection,
    RunSection,
)

SHORTHANDS = {"data": "data.source", "model": "model.factory", "balance": "balance.method"}
OPTION_SECTIONS = ("data", "model")  # their other keys are factory options

_SAME_NAME = {
    # newer than the flat keys: peak_tflops, epochs
    "run": [f.name for f in fields(RunSection) if f.name not in ("peak_tflops", "epochs")],
    "data": [
        f.name
        for f in fields(DataSection)
        if f.name not in ("source", "options", "train_negatives", "ids")
    ],
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


def resolve_alias(key: str) -> str | None:
    """The ``section.key`` an old flat key maps to (None: not an old key)."""
    return ALIASES.get(key)


def notice_text(key: str, path: str) -> str:
    return f"config key {key!r} is deprecated (removed next release): use {path!r}"


def deprecation_warning(key: str, path: str) -> None:
    """The default notice of an old flat key: a DeprecationWarning (library callers)."""
    warnings.warn(notice_text(key, path), DeprecationWarning, stacklevel=4)
