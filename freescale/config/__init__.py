"""A run's configuration: one frozen section per component, presets, keys.

Each section (`sections`) is validated once, in its ``__post_init__``
(ValueError with one clear sentence), in the launching process before any
rank starts, and handed whole to the component that owns it: ``run`` (the
job), ``data`` (the data source), ``model`` (the factory and its options:
the model checks those itself), ``embeddings`` (the sharded tables),
``dense`` (the dense optimizer), ``balance``, ``pipeline`` (schedule and
communication), ``evaluation``, ``checkpoint``, ``faults`` (injected faults
and the non-finite guard) and ``output``. `TrainConfig` holds them.

A config is a preset (`presets`, `recipes`) with ``section.key=value``
settings on top (`builder`: ``--set``; `files`: a TOML file). Names of
components (partitioners, comm backends, embedding optimizers, placements)
are checked against the package that owns them; user code is named
``module:qualname`` (`freescale.naming`).
"""

from freescale.config.builder import SHORTHANDS, ConfigBuilder, build_config, known_keys
from freescale.config.files import config_toml, format_config, load_config
from freescale.config.presets import PRESETS, h200_8k, h200_21k
from freescale.config.sections import (
    BUILTIN_MODEL,
    MODES,
    SECTIONS,
    BalanceSection,
    CheckpointSection,
    DataSection,
    DenseSection,
    EmbeddingsSection,
    EvaluationSection,
    FaultsSection,
    ModelSection,
    OutputSection,
    PipelineSection,
    RunSection,
)
from freescale.config.train_config import TrainConfig
from freescale.config.values import trace_window

__all__ = [
    "BUILTIN_MODEL",
    "MODES",
    "PRESETS",
    "SECTIONS",
    "SHORTHANDS",
    "BalanceSection",
    "CheckpointSection",
    "ConfigBuilder",
    "DataSection",
    "DenseSection",
    "EmbeddingsSection",
    "EvaluationSection",
    "FaultsSection",
    "ModelSection",
    "OutputSection",
    "PipelineSection",
    "RunSection",
    "TrainConfig",
    "build_config",
    "config_toml",
    "format_config",
    "h200_8k",
    "h200_21k",
    "known_keys",
    "load_config",
    "trace_window",
]
