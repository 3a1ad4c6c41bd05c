"""Fail fast, naming the absent ranks, when a collective call runs on some ranks only.

A swapped model's ``state_dict()`` moves rows between ranks (an AllToAll per
tensor, `state_dict.to_row_chunks`). Called on rank 0 alone, e.g. before a
``torch.save``, it would block until the process group's timeout (minutes)
and then fail far from the cause. `agree` runs first: every rank checks in
on the process group's key-value store and waits at most `TIMEOUT_S` for the
others; then every rank that took part, early or late, gets the same
verdict, decided once per round by an atomic compare-and-set: "go" when all
ranks checked in first, "abort" when a rank's wait ran out first. A late rank
thus raises too instead of entering an exchange its peers have left.

Rounds are numbered per process group and every rank must reach its rounds
in the same order, as for any collective. After an abort the program should
stop: a rank that never arrived would meet the aborted round when it does
(and raise there), so later rounds pair up again, but nothing is retried.

On success it costs a handful of store round trips (about a millisecond
on the CPU), once per swapped module per ``state_dict()``.
"""

from __future__ import annotations

import contextlib
import zlib
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# Long enough for ranks that reach the call at slightly different times (e.g.
# rank 0 logging first), short enough to beat a process-group timeout by far.
TIMEOUT_S = 10.0
_rounds: dict[str, int] = {}


def _store() -> Any:
    # The default group's store: every rank of every group reaches it.
    return dist.distributed_c10d._get_default_store()


def agree(group: Any, what: str) -> None:
    """Return when every rank of ``group`` called ``agree`` for this round; raise
    RuntimeError on every rank of the round if one did not within `TIMEOUT_S`."""
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if world == 1:
        return
    name = str(getattr(group, "group_name", "") or "world")
    n = _rounds.get(name, 0)
    _rounds[name] = n + 1
    prefix = f"freescale/agree/{zlib.crc32(name.encode()):08x}/{n}/"
    store, me = _store(), dist.get_rank(group)
    store.set(prefix + f"rank{me}", "")
    if store.add(prefix + "count", 1) == world:
        store.compare_set(prefix + "verdict", "", "go")
    # If the wait runs out, vote to abort below (unless "go" won meanwhile).
    with contextlib.suppress(dist.DistStoreError):
        store.wait([prefix + "verdict"], timedelta(seconds=TIMEOUT_S))
    verdict = store.compare_set(prefix + "verdict", "", "abort")
    if verdict == b"go":
        return
    missing = [r for r in range(world) if not store.check([prefix + f"rank{r}"])]
    absent = (
        f"ranks {missing} did not call it within {TIMEOUT_S:g} s"
        if missing
        else f"a rank was more than {TIMEOUT_S:g} s late"
    )
    raise RuntimeError(
        f"{what} is a collective: every rank must call it ({absent}). To save from "
        "one rank, save the tables through the collection on every rank and the rest "
        "inside `collection.tables_left_out()`, or use torch.distributed.checkpoint "
        "(dcp.save(model.state_dict())) on every rank."
    )
