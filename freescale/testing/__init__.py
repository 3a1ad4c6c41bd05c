"""Test helpers: the multi-rank CPU harness and random data builders."""

from freescale.testing.multirank import RankError, RankTimeout, run_ranks

__all__ = ["RankError", "RankTimeout", "run_ranks"]
