"""The partitioner signature and the runtime information it may use.

Every partitioner — built in or user supplied — is a callable

    partition(world: WorldLengths, runtime: RuntimeInfo) -> Plan

``world`` carries the inputs of the paper's Algorithm 1 (world UIH lengths,
world candidate counts, world composite candidate lengths, flat and rank-major
with per-rank counts); ``runtime`` is its R (measured execution times and what
was learnt from them). The paper's P also receives the local batch B; ours
does not, on purpose: a plan must depend only on data every rank holds
identically, so that all ranks compute the same plan without communicating.

A partitioner must be pure and deterministic: same inputs, same plan, on every
rank and every call (no randomness, no reliance on dict/set iteration of
unhashed objects, ties broken by global index).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from freescale.balance.cost import CostModel
from freescale.balance.plan import Plan
from freescale.balance.world import WorldLengths


@dataclass(frozen=True)
class RuntimeInfo:
    """What a partitioner may know besides the lengths (identical on every rank).

    - ``step``: index of the global step being balanced (0, 1, ...);
    - ``rank_times_ms``: the last observed per-rank compute times, or None;
    - ``shares``: AutoTune's per-rank target shares of the total weight (VBS);
    - ``cost_model``: the online-fitted `CostModel` (the cost partitioner);
    - ``extra``: anything else a user partitioner wants (must be rank-invariant).
    """

    step: int = 0
    rank_times_ms: tuple[float, ...] | None = None
    shares: tuple[float, ...] | None = None
    cost_model: CostModel | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")
        if self.shares is not None and (
            min(self.shares, default=0.0) < 0 or not sum(self.shares) > 0
        ):
            raise ValueError(f"shares must be >= 0 with a positive sum, got {self.shares}")


class Partitioner(Protocol):
    """``partition(world, runtime) -> Plan`` (see the module docstring)."""

    def __call__(self, world: WorldLengths, runtime: RuntimeInfo) -> Plan: ...
