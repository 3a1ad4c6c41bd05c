"""`export`: a trained run as a `torch.export` program (and an AOTInductor package).

Steps, each checkable on its own:

1. the checkpoint passes every check ``--resume`` runs, then becomes the plain
   model's state dict in this process, whatever world size wrote it
   (`freescale.serving.checkpoint`);
2. the run's factory builds the plain model from the data's schema (the
   checkpoint's record, `freescale.state.data_record`: no data file read);
   each dynamic table becomes a `DynamicEmbedding` of its held ids and rows
   (`freescale.serving.dynamic`: raw int64 ids in, zeros for an id without
   a row); the model loads that state and goes to eval mode;
3. `Program` wraps it behind the flat tensor signature
   (`freescale.serving.signature`), and `torch.export` traces it once over
   the example batch of the run's data the checkpoint keeps, with every
   jagged dimension dynamic;
4. ``OUT/model.pt2`` (`torch.export.save`), with ``aoti`` also
   ``OUT/model_aoti.pt2`` (`torch._inductor.aoti_compile_and_package`),
   ``OUT/ids/`` (the data's id maps, `freescale.data.ids`) and
   ``OUT/manifest.json``: the signature, the schema, the model and data
   options, the source checkpoint's SHA-256 and the files' own.

Tracing runs with size-oblivious reasoning for backed sizes (as torch's ONNX
exporter does), so that a program traced on an example of a few samples also
serves a batch of one sample, one candidate or no history at all; without it,
every dimension would be specialized away from 0 and 1.

Attention in the program (``attention``): ``jagged`` (the default) keeps the
sequence model's two patterns as one `torch.library` op each
(`freescale.models.attention_op`: the eval forward's own kernels, Σ L_i² work;
the program then loads only where ``freescale`` is imported); ``padded``
traces the batch padded to its widest sample (`padded_attention`, B · L_max²:
a self-contained program). HSTU traces its own ``padded`` layout either way
(docs/serving.md).

Precision (``amp``): ``bf16`` runs the forward under bf16 autocast inside the
program, as training ran it with ``dense.amp=bf16`` (the trace keeps the
autocast region; Inductor lowers it to casts); ``auto`` (`export`'s default)
follows the run on CUDA, where ``dense.amp`` applies, and is ``none`` on the
CPU. The program's output is float32 either way.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

import freescale
from freescale.config import TrainConfig
from freescale.data.ids import IDS, write_maps
from freescale.embedding.swap import plain_lookups, plain_table_rows
from freescale.embedding.table_rows import TOO_SMALL
from freescale.jagged.batch import SampleBatch
from freescale.jagged.schema import DataSchema
from freescale.jagged.tensor import JaggedFeatures
from freescale.models.attention_op import exported_attention
from freescale.models.contract import check_model
from freescale.serving import checkpoint as ck
from freescale.serving.aoti import CompileError, compile_package
from freescale.serving.dynamic import by_id_paths, load_served
from freescale.serving.failure import ExportError, explain
from freescale.serving.signature import Signature
from freescale.state.checkpoint_files import sha256_file
from freescale.state.data_record import schema_record

PROGRAM, PACKAGE, MANIFEST = "model.pt2", "model_aoti.pt2", "manifest.json"
FORMAT = 1


AMPS = ("none", "bf16")


class Program(nn.Module):
    """``model`` behind the flat signature: ``forward(*tensors) -> [C]`` float32
    logits, under bf16 autocast on ``device_type`` with ``amp="bf16"``."""

    def __init__(
        self, model: nn.Module, signature: Signature, amp: str = "none", device_type: str = "cpu"
    ) -> None:
        super().__init__()
        self.model, self.signature, self.amp, self.device_type = model, signature, amp, device_type

    def forward(self, *tensors: Tensor) -> Tensor:
        # no autocast region at all without amp: the graph stays as it was
        bf16 = self.amp == "bf16"
        with torch.autocast(self.device_type, torch.bfloat16) if bf16 else contextlib.nullcontext():
            return self.model(self.signature.unflatten(tensors)).float()


def run_amp(amp: str, config: TrainConfig, device: str) -> str:
    """``amp`` with ``auto`` resolved: the run's ``dense.amp`` on CUDA, else none."""
    _check_amp(amp, ("auto", *AMPS))
    if amp == "auto":
        return config.dense.amp if device == "cuda" else "none"
    return amp


def _check_amp(amp: str, choices: tuple[str, ...]) -> None:
    if amp not in choices:
        listed = f"{', '.join(choices[:-1])} or {choices[-1]}"
        raise ValueError(f"export: amp must be {listed}; got {amp!r}")


def export(
    checkpoint: str | Path,
    out: str | Path,
    *,
    model: Any = None,
    data: Any = None,
    device: str = "cpu",
    dynamic: bool = True,
    aoti: bool = False,
    attention: str = "jagged",
    weights: str = "auto",
    amp: str = "auto",
    say: Callable[[str], None] | None = None,
) -> Path:
    """Export the checkpoint's model into the directory ``out``; returns it.

    ``model``: the run's factory, or its ``module:name``; ``data``: the run's
    data source, or its ``module:factory`` (called with the checkpoint's data
    options). Both default to what the checkpoint's config names when that is
    FreeScale's own code; other code is imported only when the caller names
    it (a checkpoint never chooses the code that runs). ``dynamic=False``: a
    program for the example batch's shapes only. ``weights``: ``auto`` (the
    best evaluation's where the run kept one, else the latest), ``best`` or
    ``latest`` (`freescale.serving.checkpoint.chosen_weights`). ``amp``: ``auto``,
    ``bf16`` or ``none`` (the module docstring). ``say``: progress lines (the
    trace and the compile take minutes at long sequences).
    """
    found, manifest, trainer = ck.checked(checkpoint)
    config = TrainConfig.from_dict(manifest["config"])
    amp = run_amp(amp, config, device)
    factory = ck.model_factory(config, model)
    schema, example, maps = ck.export_data(found, manifest, config, data)
    plain = _build(factory, schema, config.model.options)
    chosen = ck.chosen_weights(found, trainer, weights)
    by_id = ck.dynamic_paths(config, plain)
    tables = {path: ck.dynamic_table_of(found, chosen, path) for path in by_id}
    load_served(plain, ck.plain_state(found, trainer, plain, chosen, by_id), tables)
    source_record = {
        "checkpoint": str(found),
        "manifest_sha256": ck.manifest_sha256(found),
        "step": manifest["step"],
        "world_size": manifest["world_size"],
        "weights": chosen,
    }
    if chosen == "best":
        best = trainer["best"]  # its step as the run's summary counts it (steps done)
        source_record["best"] = {"metric": best["metric"], "value": best["value"],
                                 "step": best["step"] + 1}  # fmt: skip
    options = {k: manifest["config"].get(k) for k in ("model", "data")}
    extra = {"source": source_record, "config": options}
    return export_model(plain, example, out, schema=schema, device=device, dynamic=dynamic,
                        aoti=aoti, attention=attention, amp=amp, extra=extra, say=say,
                        ids=maps)  # fmt: skip


def export_model(
    model: nn.Module,
    example: SampleBatch,
    out: str | Path,
    *,
    schema: DataSchema | None = None,
    device: str = "cpu",
    dynamic: bool = True,
    aoti: bool = False,
    attention: str = "jagged",
    amp: str = "none",
    extra: dict[str, Any] | None = None,
    say: Callable[[str], None] | None = None,
    ids: dict[str, np.ndarray] | None = None,
) -> Path:
    """Export a plain ``model`` (its current weights) traced on ``example``;
    ``attention``: ``jagged`` or ``padded``, ``amp``: ``none`` or ``bf16`` (the
    module docstring); ``say``: progress lines; ``ids``: the data's id maps
    (`freescale.data.ids`), so the served program takes the catalogue's ids."""
    say = say or (lambda msg: None)
    _check_amp(amp, AMPS)
    check_tables(model, example, schema)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target = torch.device(device)
    model = model.to(target).eval()
    example = example.to(target)
    signature = Signature.of(example)
    say(f"tracing {type(model).__name__} with torch.export ({attention} attention, amp {amp})")
    start = time.perf_counter()
    with exported_attention(attention):
        program = trace(model, signature, example, dynamic, amp)
    torch.export.save(program, out / PROGRAM)
    say(f"{out / PROGRAM} written in {time.perf_counter() - start:.1f} s")
    files, inductor, failed = [PROGRAM, *write_maps(ids or {}, out)], None, None
    if aoti:  # in a child process (`freescale.serving.aoti`): a crash there is one paragraph
        say("compiling the AOTInductor package in a child process (minutes)")
        start = time.perf_counter()
        try:
            inductor = compile_package(out / PROGRAM, out / PACKAGE)
            files.append(PACKAGE)
        except CompileError as e:
            failed = str(e)
        done = "failed" if failed else f"{out / PACKAGE} written"
        say(f"{done} in {time.perf_counter() - start:.1f} s")
    record = {
        "format": FORMAT,
        "freescale": freescale.__version__,
        "torch": torch.__version__,
        "device": target.type,
        "dynamic": dynamic,
        "attention": attention,
        "amp": amp,
        "model_class": f"{type(model).__module__}:{type(model).__qualname__}",
        "inputs": signature.inputs(),
        "signature": signature.as_dict(),
        "schema": None if schema is None else schema_record(schema),
        "output": "float32 [C]: one logit per candidate, in the candidates' order",
        "aoti_inductor_configs": inductor,
        "aoti_error": failed,
        "ids": {table: f"{IDS}/{table}.npy" for table in sorted(ids or {})},
        "dynamic_tables": _dynamic_record(model),
        **(extra or {}),
        "files": {name: [(out / name).stat().st_size, sha256_file(out / name)] for name in files},
    }
    (out / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")
    if failed:  # after the manifest: the program serves (load(OUT, aoti=False))
        raise ExportError(failed)
    return out


def trace(
    model: nn.Module,
    signature: Signature,
    example: SampleBatch,
    dynamic: bool = True,
    amp: str = "none",
) -> Any:
    """`torch.export.export` of ``model`` behind ``signature``; a model it cannot
    trace is one `ExportError` paragraph (`freescale.serving.failure`)."""
    shapes = (signature.dynamic_shapes(),) if dynamic else None
    try:
        with torch.no_grad(), _size_oblivious():
            return torch.export.export(
                Program(model, signature, amp, example.device.type),
                signature.flatten(example),
                dynamic_shapes=shapes,
            )
    except Exception as e:
        raise explain(e, model) from None


def check_tables(model: nn.Module, example: SampleBatch, schema: DataSchema | None) -> None:
    """One line if a table of ``model`` is smaller than the ids it is given for
    ``example`` or, with ``schema``, for the data's largest ids: the program
    would index past it (an exported table has no neighbour to read, but a
    served batch would fail inside the program, far from the cause). A dynamic
    table served by id (`DynamicEmbedding`) takes any int64 id: not checked."""
    by_id = by_id_paths(model)  # dynamic tables: any int64 id, unknown ones read zeros
    rows, example = plain_table_rows(model, by_id), example.to(torch.device("cpu"))
    batches = [("the example batch", example)]
    if schema is not None:
        batches.append(("the data's largest ids", _largest_ids(example, schema)))
    for what, batch in batches:
        bad = rows.first_beyond(plain_lookups(model, batch, by_id))
        if bad is not None:
            raise ValueError(f"export: {rows.describe(*bad)} for {what}: {TOO_SMALL}")


def _dynamic_record(model: nn.Module) -> dict[str, dict[str, int]]:
    """``{path: {"ids": held, "dim": dim}}`` of the tables the program serves by id."""
    record = {}
    for path in by_id_paths(model):
        module = model.get_submodule(path)
        record[path] = {"ids": int(module.ids.shape[0]), "dim": module.embedding_dim}
    return record


def _largest_ids(batch: SampleBatch, schema: DataSchema) -> SampleBatch:
    """``batch`` with every id feature ``schema`` declares at its largest id (rows - 1;
    raw ids have no largest: a dynamic table takes any)."""
    levels = {}
    for level in ("uih", "candidates", "content"):
        jagged: JaggedFeatures = getattr(batch, level)
        features = dict(jagged.features)
        for f in schema.features:
            if f.level == level and f.bounded and f.name in features:
                features[f.name] = torch.full_like(features[f.name], f.rows - 1)
        levels[level] = JaggedFeatures(jagged.offsets, features)
    return replace(batch, **levels)


@contextlib.contextmanager
def _size_oblivious() -> Iterator[None]:
    """Backed sizes in [0, inf) without 0/1 guards (torch >= 2.7; a no-op before)."""
    config = torch.fx.experimental._config
    if not hasattr(config, "backed_size_oblivious"):
        yield
        return
    with config.patch(backed_size_oblivious=True):
        yield


def _build(factory: Any, schema: DataSchema, options: dict[str, Any]) -> nn.Module:
    try:
        built = factory(schema, **options)
    except TypeError as e:
        raise ValueError(f"export: factory(schema, **model options) failed: {e}") from None
    check_model(built, "export")
    return built
