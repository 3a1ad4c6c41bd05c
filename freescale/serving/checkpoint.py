"""A training checkpoint as the plain model's state, in one process.

A checkpoint holds the dense weights (``trainer.pt``) and every table in
contiguous row chunks (``tables/``, torch DCP), written by any number of
ranks. Here one process without a process group reads every chunk of every
table into one full tensor (DCP reshards to a single reader as it does to W'
ranks) under the key the *plain* model's ``state_dict`` has, beside the dense
weights: the model the run's factory builds loads it as it is. A run with
``evaluation.keep_best`` also checkpointed its best evaluation's weights
(``best/`` and ``trainer.pt``'s ``best``): `chosen_weights` picks them or
the latest.

Nothing is used before the checkpoint passes the checks ``--resume`` runs
(`freescale.state.checkpoint_files.read_checked`: sizes, SHA-256 of every
file, plain content, the tables' index): a tampered checkpoint is refused
with the same one line (docs/security.md).
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from freescale.config import BUILTIN_MODEL, TrainConfig
from freescale.data.ids import IDS, ITEMS
from freescale.data.source import BUILTIN_KINDS, READERS, id_maps, schema_of
from freescale.embedding.state.dcp_safe import SafeReader, read_metadata
from freescale.embedding.state.dynamic_entries import rows_by_id
from freescale.jagged.batch import SampleBatch
from freescale.jagged.schema import DataSchema
from freescale.models.contract import load_object
from freescale.pipeline.setup import make_source
from freescale.serving.dynamic import IdRows, embedding_at
from freescale.state.checkpoint import find_checkpoint, read_manifest
from freescale.state.checkpoint_files import BEST, MANIFEST, TABLES, read_checked, sha256_file
from freescale.state.data_record import example_batch, recorded

# Factories a checkpoint may name: code FreeScale ships. Any other must be
# named by the caller (a checkpoint never decides what code runs).
BUILTIN_FACTORIES = (BUILTIN_MODEL, "freescale.models.hstu:build")


def checked(path: str | Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """(the checkpoint directory, its manifest, its trainer state), after every
    check ``--resume`` runs; one-line ValueError otherwise."""
    found = find_checkpoint(path)
    if found is None:
        raise ValueError(f"export: no complete checkpoint in {str(path)!r}")
    manifest = read_manifest(found)
    world = manifest["world_size"]
    trainer, _ = read_checked(found, manifest, range(world), manifest["files"])
    if "model" not in trainer:
        raise ValueError(f"export: {found} holds no model state")
    return found, manifest, trainer


def manifest_sha256(checkpoint: Path) -> str:
    """The checkpoint's digest: its manifest's, which pins every other file."""
    return sha256_file(checkpoint / MANIFEST)


def confirm_code(config: TrainConfig, model: str | None, data: str | None, command: str) -> None:
    """A checkpoint's config names its model factory and data source; code that
    FreeScale does not ship runs only when the caller names the same
    (``model`` / ``data``: ``module:name`` or None). One-line ValueError else."""
    named = (
        ("model", config.model.factory, model, config.model.factory in BUILTIN_FACTORIES),
        ("data", config.data.source, data, config.data.source.partition(":")[0] in BUILTIN_KINDS),
    )
    for key, saved, given, shipped in named:
        if key == "data" and shipped and given is not None and is_builtin(given):
            continue  # where the run's data is now: a location, checked for its schema
        if given is None and not shipped:
            raise ValueError(
                f"{command}: the checkpoint was trained with {key}={saved}; name it (--{key} "
                f"{saved}, or {key}= in Python) to import it: a checkpoint never chooses the "
                "code that runs (docs/security.md)"
            )
        if given is not None and given != saved:
            raise ValueError(
                f"{command}: the checkpoint was trained with {key}={saved}, not {given}"
            )


def is_builtin(spec: str) -> bool:
    return spec.partition(":")[0] in BUILTIN_KINDS


def relocated(config: TrainConfig, data: str | None, checkpoint: Path) -> TrainConfig:
    """``config`` reading its data from ``data`` (a built-in spec: where the run's
    data is now; None: where it was) through the checkpoint's id maps, so the
    file's raw ids land on the rows the model was trained with."""
    source = data if data is not None and is_builtin(data) else config.data.source
    ids = str(checkpoint / IDS) if (checkpoint / IDS / f"{ITEMS}.npy").is_file() else ""
    if source.partition(":")[0] not in READERS:
        ids = ""
    return config.with_values(data__source=source, data__ids=ids)


def check_schema(saved: DataSchema, found: DataSchema, spec: str, command: str) -> None:
    """One line unless the data at ``spec`` has the checkpoint's schema (raw ids'
    count is no part of it: any file of such ids fits, `freescale.data.ids`)."""
    if _layout(found) == _layout(saved):
        return
    was = {f.key: "raw ids" if f.raw else f.rows for f in saved.features}
    now = {f.key: "raw ids" if f.raw else f.rows for f in found.features}
    key = next((k for k in [*was, *now] if was.get(k, -1) != now.get(k, -1)), "dense_dim")

    def said(m: dict) -> str:
        if key not in m:
            return "none"
        return f"{m[key]} rows" if isinstance(m[key], int) else m[key] or "present"

    raise ValueError(
        f"{command}: {spec} is not the run's data: {key} {said(now)}, the checkpoint's "
        f"{said(was)} (a file elsewhere must hold the same schema)"
    )


def _layout(schema: DataSchema) -> DataSchema:
    """``schema`` with the count of each raw id feature left out."""
    return replace(
        schema, features=tuple(replace(f, rows=1) if f.raw else f for f in schema.features)
    )


def export_data(
    checkpoint: Path, manifest: dict[str, Any], config: TrainConfig, data: Any
) -> tuple[DataSchema, SampleBatch, dict[str, Any]]:
    """(schema, example batch, id maps) an export of ``checkpoint`` is made from:
    its own record, no data file read, unless ``data`` is given (a
    `DataSource`, the run's ``module:factory``, or a built-in spec naming where
    the run's data is now) or the checkpoint predates the record."""
    record = recorded(checkpoint, manifest)
    if data is None and record is not None and record["example"] is not None:
        return record["schema"], record["example"], record["maps"]
    if data is None or isinstance(data, str):
        confirm_code(config, config.model.factory, data, "export")  # the data only
        moved = relocated(config, data, checkpoint)
        source, spec = make_source(moved), moved.data.source
    else:
        source, spec = data, type(data).__name__
    schema = schema_of(source)
    if record is not None:
        check_schema(record["schema"], schema, spec, "export")
    maps = id_maps(source) or (record["maps"] if record is not None else {})
    return schema, example_batch(source, config.run.batch_size), maps


def model_factory(config: TrainConfig, given: Any = None) -> Any:
    """The factory the run used: ``given`` (a factory or its ``module:name``) or,
    for FreeScale's own models, the one the checkpoint names."""
    if given is not None and not isinstance(given, str):
        return given
    confirm_code(config, given, config.data.source, "export")  # the model only
    return load_object(config.model.factory, "model")


def table_keys(model: nn.Module, by_id: Collection[str] = ()) -> dict[str, str]:
    """``{checkpoint table entry: the plain model's state-dict key}`` of the
    model's sharded modules (`freescale.embedding.swap` names the tables), but
    those at the ``by_id`` paths (dynamic tables: `dynamic_table_of`)."""
    modules = dict(model.named_modules())
    keys: dict[str, str] = {}
    for path in model.sharded_modules:  # type: ignore[union-attr]
        if path in by_id:
            continue
        module = modules[path]
        if isinstance(module, nn.Embedding):
            keys[f"{path}.weight"] = f"{path}.weight"
            continue
        for name in getattr(module, "embeddings", {}):  # a TorchRec EmbeddingCollection
            keys[f"{path}.{name}.weight"] = f"{path}.embeddings.{name}.weight"
    return keys


WEIGHTS = ("auto", "best", "latest")


def chosen_weights(checkpoint: Path, trainer: dict[str, Any], weights: str) -> str:
    """``best`` or ``latest``: which weights of ``checkpoint`` ``weights`` asks for.
    ``auto``: the best evaluation's where the run kept one (``evaluation.keep_best``,
    as its own final evaluation used them), else the latest."""
    if weights not in WEIGHTS:
        raise ValueError(f"export: weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    has_best = "value" in trainer.get("best", {}) and (checkpoint / BEST).is_dir()
    if weights == "best" and not has_best:
        raise ValueError(
            f"export: {checkpoint} holds no best evaluation (a run with evaluation.keep_best "
            "writes one after its first evaluation): export the latest weights"
        )
    return "best" if weights == "best" or (weights == "auto" and has_best) else "latest"


def plain_state(
    checkpoint: Path,
    trainer: dict[str, Any],
    model: nn.Module,
    weights: str = "latest",
    by_id: Collection[str] = (),
) -> dict[str, Tensor]:
    """The plain model's full state dict: dense weights and gathered tables, the
    latest or (``weights="best"``) the best evaluation's (`chosen_weights`);
    without the dynamic tables at the ``by_id`` paths (`dynamic_table_of`)."""
    keys = table_keys(model, by_id)
    best = weights == "best"
    rows = checkpoint / (BEST if best else TABLES)
    saved = read_metadata(rows).state_dict_metadata
    missing = sorted(set(keys) - set(saved))
    if missing:
        raise ValueError(f"export: {checkpoint} holds no table {', '.join(missing)}")
    tables = _read_entries(rows, saved, keys)
    dense = trainer["best"]["dense"] if best else trainer["model"]
    return {**dense, **{keys[k]: t for k, t in tables.items()}}


def _read_entries(rows: Path, saved: dict[str, Any], entries: Iterable[str]) -> dict[str, Tensor]:
    """Whole tensors of ``entries`` of the DCP directory ``rows`` (index ``saved``)."""
    tables = {}
    for entry in entries:
        meta = saved[entry]
        tables[entry] = torch.empty(meta.size, dtype=meta.properties.dtype)
    with warnings.catch_warnings():  # "no process group: loading in one process", as meant
        warnings.simplefilter("ignore", UserWarning)
        torch.distributed.checkpoint.load(tables, storage_reader=SafeReader(rows), no_dist=True)
    return tables


def dynamic_paths(config: TrainConfig, model: nn.Module) -> list[str]:
    """The paths of ``model``'s dynamic tables (``embeddings.tables.NAME.capacity``
    > 0 in the run's config); one line for one a served program cannot hold by id
    yet (a table of a TorchRec ``EmbeddingCollection``)."""
    paths = []
    for name in sorted(config.embeddings.dynamics()):
        if embedding_at(model, name) is None:
            raise ValueError(
                f"export: dynamic table {name!r} is not an nn.Embedding of the model: a "
                "dynamic table inside a TorchRec EmbeddingCollection does not export yet"
            )
        paths.append(name)
    return paths


# A dynamic table's entries under ``<table>.``: every slot's row, the id each
# slot holds and whether it holds one (all ranks' slots, one after another).
BY_ID = ("weight", "dynamic.slot_ids", "dynamic.occupied")


def dynamic_table_of(checkpoint: Path, weights: str, table: str) -> IdRows:
    """(ids sorted ascending, int64 [n]; rows [n, dim]) of dynamic table
    ``table`` in ``checkpoint``, the latest or (``weights="best"``) the best
    evaluation's: the ids held over every rank and each one's row, as
    ``collection.dynamic_rows(table)`` gives them in the run.

    It reads the table's slots with the id each holds (`BY_ID`). A checkpoint
    that keeps only the slots (no ``dynamic.slot_ids``) cannot be keyed by id:
    one line, never its slots loaded as rows.
    """
    rows = checkpoint / (BEST if weights == "best" else TABLES)
    saved = read_metadata(rows).state_dict_metadata
    weight, slot_ids, occupied = (f"{table}.{name}" for name in BY_ID)
    if weight not in saved:
        raise ValueError(f"export: {checkpoint} holds no table {weight}")
    if slot_ids not in saved or occupied not in saved:
        raise ValueError(
            f"export: {checkpoint} holds dynamic table {table!r} by slot, without the id of "
            "each row: a served program takes raw ids, so it needs a checkpoint that keeps "
            f"them ({slot_ids}); this one was written without"
        )
    entries = _read_entries(rows, saved, (weight, slot_ids, occupied))
    ids, by_id, _ = rows_by_id(entries, f"{table}.")
    return ids, by_id
