"""Serving (layer 3): a trained run as an exported program, and loading it.

- `export` (`freescale.serving.exporter`): checkpoint -> ``OUT/model.pt2``
  (`torch.export`), optionally ``OUT/model_aoti.pt2`` (AOTInductor), and
  ``OUT/manifest.json``; also ``freescale export`` and `freescale.export`;
- `load` (`freescale.serving.loader`): ``OUT`` -> a callable scoring a
  `SampleBatch` (or the flat tensors) on CPU or CUDA;
- `Signature`: the flat tensor inputs of an exported program.

Imported on first use: `torch.export` is not loaded by ``import freescale``.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "export": "freescale.serving.exporter",
    "export_model": "freescale.serving.exporter",
    "load": "freescale.serving.loader",
    "Served": "freescale.serving.loader",
    "Signature": "freescale.serving.signature",
    "ExportError": "freescale.serving.failure",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'freescale.serving' has no attribute {name!r}")
