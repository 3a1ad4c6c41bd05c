"""Moved to `freescale.config` (this alias goes in the next release)."""

import warnings

from freescale.config import *  # noqa: F403
from freescale.config import __all__  # noqa: F401

warnings.warn(
    "freescale.pipeline.config moved to freescale.config (this alias goes in the next release)",
    DeprecationWarning,
    stacklevel=2,
)
