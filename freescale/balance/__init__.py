"""Sequence load balancing (layer 2): the paper's Algorithm 1 and its partitioners.

- `WorldLengths`: the per-sample sizes of a global step (stages I–II).
- `Plan`, `check_plan`: where each sample goes and in which order it lands.
- Partitioners, all ``partition(world, runtime) -> Plan``: `identity`
  ("none"), `FBS`, `VBS` (+ `AutoTune`), `CostPartitioner` (+ `CostModel`),
  or any user callable; `resolve_partitioner` maps config names to them.
- `LoadBalancer`: the three communication stages over a `Communicator`.

See docs/balance.md.
"""

from freescale.balance.balancer import BalanceHandle, BalancerConfig, LoadBalancer
from freescale.balance.cost import CostModel, CostModelConfig
from freescale.balance.costpart import CostPartitioner, karmarkar_karp_plan, lpt_plan
from freescale.balance.exchange import PendingExchange, schema_fingerprint, start_exchange
from freescale.balance.fbs import FBS, identity, zigzag_plan, zigzag_ranks
from freescale.balance.plan import Plan, check_plan, equal_counts, idle_fraction, rank_loads
from freescale.balance.registry import (
    partitioner_names,
    register_partitioner,
    resolve_partitioner,
)
from freescale.balance.routing import Routing, route
from freescale.balance.runtime import Partitioner, RuntimeInfo
from freescale.balance.vbs import VBS, AutoTune, AutoTuneConfig, segment_bounds
from freescale.balance.world import FEATURES, WorldLengths, batch_features, sample_features

__all__ = [
    "FBS",
    "FEATURES",
    "VBS",
    "AutoTune",
    "AutoTuneConfig",
    "BalanceHandle",
    "BalancerConfig",
    "CostModel",
    "CostModelConfig",
    "CostPartitioner",
    "LoadBalancer",
    "Partitioner",
    "PendingExchange",
    "Plan",
    "Routing",
    "RuntimeInfo",
    "WorldLengths",
    "batch_features",
    "check_plan",
    "equal_counts",
    "identity",
    "idle_fraction",
    "karmarkar_karp_plan",
    "lpt_plan",
    "partitioner_names",
    "rank_loads",
    "register_partitioner",
    "resolve_partitioner",
    "route",
    "sample_features",
    "schema_fingerprint",
    "segment_bounds",
    "start_exchange",
    "zigzag_plan",
    "zigzag_ranks",
]
