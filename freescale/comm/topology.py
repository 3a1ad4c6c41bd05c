"""Which ranks share a host: from torchrun's variables or an explicit override, never hostnames.

Hostnames lie in containers (every pod may be ``localhost``) and say nothing
about whether ``/dev/shm`` is shared; the launcher knows. Sources, in order:

1. ``ranks_per_host=k`` (tests emulating several hosts on one machine):
   rank ``g`` is on host ``g // k``.
2. torchrun's ``GROUP_RANK`` (the node rank) with ``LOCAL_WORLD_SIZE``: ranks
   with equal ``GROUP_RANK`` share a host.
3. Neither: every rank is assumed to be on one host (single-node launches
   such as ``mp.spawn``); the shm transport then checks it, failing with a
   clear error when a peer's segment is not visible.

Every rank contributes its own key through one ``all_gather_object``, so all
ranks agree on the result even if their environments disagree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """``hosts[g]``: host index (0..H-1) of rank g; ``source``: how it was found."""

    hosts: tuple[int, ...]
    source: str

    @property
    def num_hosts(self) -> int:
        return len(set(self.hosts))

    def ranks_of(self, host: int) -> list[int]:
        return [g for g, h in enumerate(self.hosts) if h == host]

    def local_ranks(self, rank: int) -> list[int]:
        """Ranks on ``rank``'s host (itself included), ascending."""
        return self.ranks_of(self.hosts[rank])

    def local_index(self, rank: int) -> int:
        return self.local_ranks(rank).index(rank)

    def uniform(self) -> bool:
        """Every host has the same number of ranks."""
        return len({len(self.ranks_of(h)) for h in set(self.hosts)}) == 1


def host_key(rank: int, ranks_per_host: int | None, env: Mapping[str, str]) -> tuple[Any, str]:
    """This rank's host key and where it came from (see module doc)."""
    if ranks_per_host is not None:
        if ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {ranks_per_host}")
        return rank // ranks_per_host, "ranks_per_host"
    if "GROUP_RANK" in env and "LOCAL_WORLD_SIZE" in env:
        return int(env["GROUP_RANK"]), "torchrun"
    return 0, "assumed single host"


def detect_topology(
    group: Any = None, ranks_per_host: int | None = None, env: Mapping[str, str] | None = None
) -> Topology:
    """Gather every rank's host key over ``group`` (collective); number hosts 0..H-1."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    mine = host_key(rank, ranks_per_host, os.environ if env is None else env)
    keys: list[Any] = [None] * world
    dist.all_gather_object(keys, mine, group=group)
    order = {k: i for i, k in enumerate(sorted({k for k, _ in keys}))}
    sources = sorted({s for _, s in keys})
    return Topology(tuple(order[k] for k, _ in keys), "/".join(sources))
