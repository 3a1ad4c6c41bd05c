"""`load`: an export directory as a callable that scores candidates.

``load(OUT)(batch)`` -> one logit per candidate of ``batch`` (a `SampleBatch`),
or ``load(OUT)(*tensors)`` with the flat signature (`Signature.inputs`, in the
manifest). Either runs the AOTInductor package when the directory has one
built for the device asked for, else the `torch.export` program; every file is
checked against the manifest's SHA-256 before it is loaded. An AOTInductor
package is compiled code that loading runs: load only exports you made or
trust (docs/security.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from freescale.data.ids import FEATURES, RowsOf, read_maps
from freescale.jagged.batch import SampleBatch
from freescale.models import attention_op  # noqa: F401  (registers the op programs call)
from freescale.serving.exporter import FORMAT, MANIFEST, PACKAGE, PROGRAM
from freescale.serving.signature import Signature
from freescale.state.checkpoint_files import sha256_file


class Served:
    """A loaded export: ``served(batch)`` or ``served(*tensors)`` -> logits [C].

    ``ids``: ``{table: raw ids by row}`` (`freescale.data.ids`); with them the
    inputs hold the catalogue's own ids, mapped to rows here (an id the map
    lacks is a one-line ValueError); without, rows as the model indexes them."""

    def __init__(
        self, program: Any, signature: Signature, device: torch.device, kind: str,
        weights: dict[str, Tensor] | None = None, ids: dict[str, np.ndarray] | None = None,
    ) -> None:  # fmt: skip
        self.program, self.signature, self.device = program, signature, device
        self.kind = kind  # "aoti" | "export"
        self.weights = weights  # what an AOTInductor package reads in place: kept alive here
        self.rows = {
            feature: RowsOf(raw, "the export's id map")
            for table, raw in (ids or {}).items()
            for feature in FEATURES.get(table, ())
        }

    @property
    def raw_ids(self) -> bool:
        """Whether inputs hold the catalogue's raw ids (mapped to rows here)."""
        return bool(self.rows)

    def __call__(self, *inputs: Any) -> Tensor:
        if len(inputs) == 1 and isinstance(inputs[0], SampleBatch):
            tensors = self.signature.flatten(inputs[0].to(self.device))
        else:
            self.signature.check(inputs)
            tensors = inputs
        if self.rows:
            tensors = tuple(
                self.rows[name](t, name) if name in self.rows else t
                for (name, _), t in zip(self.signature.inputs(), tensors, strict=True)
            )
        with torch.no_grad():
            return self.program(*tensors)

    def flatten(self, batch: SampleBatch) -> tuple[Tensor, ...]:
        """``batch`` as the program's flat inputs (on this export's device)."""
        return self.signature.flatten(batch.to(self.device))


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The export's manifest, its files checked (sizes and SHA-256); one-line ValueError."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{directory} is not a FreeScale export ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ValueError(f"{directory / MANIFEST}: not an export manifest of format {FORMAT}")
    for name, (size, digest) in manifest["files"].items():
        path = directory / name
        if not path.is_file() or path.stat().st_size != size or sha256_file(path) != digest:
            raise ValueError(f"export file {path} is missing, altered or damaged (manifest)")
    return manifest


def load(
    directory: str | Path,
    device: str | None = None,
    aoti: bool | None = None,
    raw_ids: bool | None = None,
) -> Served:
    """The export in ``directory`` on ``device`` (default: the one it was made
    for). ``aoti``: None: the AOTInductor package where there is one for that
    device; True: it (ValueError without); False: the `torch.export` program.
    ``raw_ids``: None: inputs hold the catalogue's own ids where the export
    has an id map (the data's reader remapped them), else rows; True: raw ids
    (ValueError without a map); False: rows."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    maps = read_maps(directory) if manifest.get("ids") else {}
    if raw_ids and not maps:
        raise ValueError(f"{directory} has no id map: its inputs are rows (raw_ids=False)")
    maps = maps if raw_ids is not False else {}
    made_for = torch.device(manifest["device"])
    target = torch.device(device) if device is not None else made_for
    signature = Signature.from_dict(manifest["signature"])
    has_package = PACKAGE in manifest["files"] and target.type == made_for.type
    if aoti and not has_package:
        raise ValueError(f"{directory} has no AOTInductor package for {target.type}")
    program = torch.export.load(directory / PROGRAM)
    if has_package and aoti is not False:
        package, weights = _package(directory / PACKAGE, program)
        return Served(package, signature, target, "aoti", weights, maps)
    if target.type != made_for.type:
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, target)
    return Served(program.module(), signature, target, "export", ids=maps)


def _package(path: Path, program: Any) -> tuple[Any, dict[str, Tensor]]:
    """The AOTInductor package at ``path`` given the program's weights (a
    package holds none: `freescale.serving.aoti.WEIGHTS`), and those weights."""
    from torch._inductor import aoti_load_package

    from freescale.serving.aoti import give_weights

    compiled = aoti_load_package(str(path))
    return compiled, give_weights(compiled, program, path)
