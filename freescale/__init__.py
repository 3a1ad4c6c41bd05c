"""FreeScale: bubble-free distributed training of sequence recommendation models.

Importing this package is cheap by design: it initializes no CUDA context, no
process group and does not import Triton. The public API below is imported
on first use:

- `train` (`freescale.api`): train a model from Python, get back the
  summary, the per-step metrics and (on request) the trained weights;
- `export` (`freescale.serving`): a checkpoint as a `torch.export` program
  (and an AOTInductor package) that `freescale.serving.load` serves;
- `RecModel` (`freescale.models.contract`): the model contract;
- `DataSchema`, `Feature` (`freescale.jagged.schema`): the data's features;
- `SampleBatch`, `JaggedFeatures`, `JaggedTensor`: the batch a model's
  ``forward`` receives, its features sharing one offsets, one feature;
  `segment_ids` (each packed row's segment), `segment_mean` and `mean_content` (each
  candidate's mean content embedding): pooling over jagged rows;
- `TrainConfig`, `build_config`: the run's configuration; `load_config`,
  `config_toml`: the same as a TOML file (`freescale.config.files`).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_PUBLIC = {
    "train": "freescale.api",
    "export": "freescale.serving.exporter",
    "TrainResult": "freescale.api",
    "RecModel": "freescale.models.contract",
    "DataSchema": "freescale.jagged.schema",
    "Feature": "freescale.jagged.schema",
    "SampleBatch": "freescale.jagged.batch",
    "JaggedTensor": "freescale.jagged.tensor",
    "JaggedFeatures": "freescale.jagged.tensor",
    "segment_ids": "freescale.jagged.ops",
    "mean_content": "freescale.models.pooling",
    "segment_mean": "freescale.models.pooling",
    "TrainConfig": "freescale.config",
    "build_config": "freescale.config",
    "load_config": "freescale.config.files",
    "config_toml": "freescale.config.files",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'freescale' has no attribute {name!r}")
