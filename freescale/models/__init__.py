"""Reference sequence model(s) (layer 3): single-device code."""

from freescale.models.hstu import HSTUConfig, HSTUModel
from freescale.models.loss import bce_loss, normalized_entropy
from freescale.models.sequence import SequenceModel
from freescale.models.sequence_config import ModelConfig

__all__ = [
    "HSTUConfig",
    "HSTUModel",
    "ModelConfig",
    "SequenceModel",
    "bce_loss",
    "normalized_entropy",
]
