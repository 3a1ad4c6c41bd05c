"""Data sources (layer 2): synthetic long-tail generator and real-data readers."""

from freescale.data.distributions import LengthDistribution
from freescale.data.readers import DataFormatError, read_movielens, read_sasrec
from freescale.data.sequences import SequenceSampling, SequenceSource
from freescale.data.source import DataSource, open_source
from freescale.data.synthetic import SyntheticConfig, SyntheticSource

__all__ = [
    "DataFormatError",
    "DataSource",
    "LengthDistribution",
    "SequenceSampling",
    "SequenceSource",
    "SyntheticConfig",
    "SyntheticSource",
    "open_source",
    "read_movielens",
    "read_sasrec",
]
