"""What a checkpoint keeps of its data, so it evaluates and exports elsewhere.

A checkpoint's manifest names its data source with an absolute path (and the
SHA-256 of a single data file: read whole by its reader anyway, so cheap),
and its schema (features, levels, table rows). Beside them, hashed in the
manifest like every file: ``example.pt``, an example batch of the run's data
(`example_batch`: what `freescale export` traces on, so an export needs no
data file), and ``ids/<table>.npy``, the raw ids the reader remapped
(`freescale.data.ids`), so an evaluation and a served model take the
catalogue's own ids.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from freescale.data.ids import read_maps, write_maps
from freescale.data.source import READERS, id_maps, schema_of
from freescale.jagged.batch import SampleBatch
from freescale.jagged.schema import DataSchema, Feature
from freescale.jagged.tensor import JaggedFeatures
from freescale.state.checkpoint_files import safe_load, sha256_file, write_plain

EXAMPLE = "example.pt"
EXAMPLE_SAMPLES = 8  # samples of the example batch a program is traced on
LEVELS = ("uih", "candidates", "content")


def schema_record(schema: DataSchema) -> dict[str, Any]:
    return {"features": [asdict(f) for f in schema.features], "dense_dim": schema.dense_dim}


def schema_from_record(record: dict[str, Any]) -> DataSchema:
    features = tuple(Feature(**f) for f in record["features"])
    return DataSchema(features, record.get("dense_dim", 0))


def data_file_sha256(spec: str) -> str | None:
    """The SHA-256 of the data file of a file reader's ``spec``; None for other data."""
    kind, _, path = spec.partition(":")
    if kind not in READERS or not Path(path).is_file():
        return None
    return sha256_file(Path(path))


def example_batch(source: Any, batch_size: int) -> SampleBatch:
    """A batch of the run's data with at least 2 of everything a program keeps
    dynamic (a size of 0 or 1 would be specialized by the tracer)."""
    parts, step = [], 0
    while True:
        parts.append(source.batch(step, 0, 1, max(EXAMPLE_SAMPLES, min(batch_size, 64))))
        batch = SampleBatch.concat(parts)
        sizes = _dynamic_sizes(batch)
        if min(sizes.values()) >= 2:
            return batch
        step += 1
        if step == 4:
            few = {k for k, v in sizes.items() if v < 2}
            if few == {"content items"} and batch.num_candidates_total >= 2:
                return _with_content(batch)
            named = ", ".join(f"{k} ({sizes[k]})" for k in sorted(few))
            raise ValueError(f"export: the data's first batches have too few {named} to trace on")


def _with_content(batch: SampleBatch) -> SampleBatch:
    """``batch`` with one content item (id 0 of each content feature) for each of
    its first two candidates: data without content (a SASRec file) still traces a
    program dynamic in them, which then serves its batches with none."""
    n = batch.num_candidates_total
    lengths = torch.zeros(n, dtype=torch.int64, device=batch.content.offsets.device)
    lengths[:2] = 1
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    features = {
        name: values.new_zeros((2, *values.shape[1:]))
        for name, values in batch.content.features.items()
    }
    return replace(batch, content=JaggedFeatures(offsets, features))


def _dynamic_sizes(batch: SampleBatch) -> dict[str, int]:
    return {
        "samples": batch.batch_size,
        "history tokens": batch.uih.offsets[-1].item(),
        "candidates": batch.num_candidates_total,
        "content items": batch.content.offsets[-1].item(),
    }


def batch_state(batch: SampleBatch) -> dict[str, Any]:
    """``batch`` as plain tensors (a checkpoint file loads with ``weights_only``)."""
    state: dict[str, Any] = {"labels": batch.labels, "sample_id": batch.sample_id}
    for level in LEVELS:
        part: JaggedFeatures = getattr(batch, level)
        state[level] = {"offsets": part.offsets, **{f"f.{k}": v for k, v in part.features.items()}}
    if batch.dense is not None:
        state["dense"] = batch.dense
    return state


def batch_from_state(state: dict[str, Any]) -> SampleBatch:
    parts = {}
    for level in LEVELS:
        held = state[level]
        features = {k[2:]: v for k, v in held.items() if k.startswith("f.")}
        parts[level] = JaggedFeatures(held["offsets"], features)
    return SampleBatch(labels=state["labels"], sample_id=state["sample_id"],
                       dense=state.get("dense"), **parts)  # fmt: skip


class DataRecord:
    """Writes the data's part of a checkpoint (rank 0): ``source`` is the run's
    `DataSource`, ``spec`` its ``data.source``; the example and the file's
    digest are made once, at the first checkpoint."""

    def __init__(self, source: Any, spec: str, batch_size: int) -> None:
        self.source, self.spec, self.batch_size = source, spec, batch_size
        self._made: tuple[dict[str, Any], dict[str, Tensor] | None] | None = None

    def _make(self) -> tuple[dict[str, Any], dict[str, Tensor] | None]:
        if self._made is None:
            example = None
            # (a streamed source reads one stream per rank: no detour through a world of 1)
            # (too little data to trace on: no example, export then asks for --data)
            if not hasattr(self.source, "with_segments"):
                with contextlib.suppress(ValueError):
                    example = batch_state(example_batch(self.source, self.batch_size).to("cpu"))
            record = {
                "source": self.spec,
                "sha256": data_file_sha256(self.spec),
                "schema": schema_record(schema_of(self.source)),
                "example": EXAMPLE if example is not None else None,
            }
            self._made = (record, example)
        return self._made

    def write(self, directory: Path) -> dict[str, Any]:
        """Write ``example.pt`` and ``ids/`` into ``directory``; the manifest's ``data``."""
        record, example = self._make()
        if example is not None:
            write_plain(example, directory / EXAMPLE)
        return {**record, "ids": write_maps(id_maps(self.source), directory)}


def recorded(checkpoint: Path, manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest's ``data`` with its schema, example batch and id maps loaded
    (the files were checked against the manifest before); None for a
    checkpoint written before checkpoints kept them."""
    data = manifest.get("data")
    if not isinstance(data, dict):
        return None
    example = data.get("example")
    return {
        **data,
        "schema": schema_from_record(data["schema"]),
        "example": batch_from_state(safe_load(checkpoint / EXAMPLE)) if example else None,
        "maps": read_maps(checkpoint),
    }
