"""Reference sequence model(s) (layer 3): single-device code."""

from freescale.models.hstu import HSTUConfig, HSTUModel
from freescale.models.loss import bce_loss, normalized_entropy
from freescale.models.sequence import ModelConfig, SequenceModel

__all__ = [
    "HSTUConfig",
    "HSTUModel",
    "ModelConfig",
    "SequenceModel",
    "bce_loss",
    "normalized_entropy",
]
