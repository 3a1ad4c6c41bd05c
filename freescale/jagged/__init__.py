"""Jagged data model (layer 1): jagged tensors, `SampleBatch`, reference ops."""

from freescale.jagged.batch import SampleBatch
from freescale.jagged.tensor import JaggedFeatures, JaggedTensor

__all__ = ["JaggedFeatures", "JaggedTensor", "SampleBatch"]
