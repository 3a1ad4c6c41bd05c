"""Run the partitioner in a helper process, off the trainer's GIL.

The partitioners are Python and numpy loops (the cost partitioner: ~1 ms
per call for 8 x 128 samples, ~9 ms for 512 x 128, on one core). On the balancer's helper thread
they hold the GIL that the trainer's launch thread needs; in a process of
their own they cost the trainer nothing. The process is started once (from a
forkserver, so it inherits no CUDA or NCCL state) and reused; every call
pickles its inputs (lengths, the runtime information with the fitted cost
model) and the plan back, a few kilobytes. The plan is the same as in-process:
partitioners are pure functions of their inputs (`freescale.balance.runtime`).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
from concurrent.futures import ProcessPoolExecutor

from freescale.balance.plan import Plan
from freescale.balance.runtime import Partitioner, RuntimeInfo
from freescale.balance.world import WorldLengths


def _partition(partitioner: Partitioner, world: WorldLengths, info: RuntimeInfo) -> Plan:
    return partitioner(world, info)


class ProcessPlanner:
    """``planner(partitioner, world, info)``: ``partitioner(world, info)`` in a helper process."""

    def __init__(self, partitioner: Partitioner) -> None:
        try:
            pickle.dumps(partitioner)
        except Exception as e:  # lambdas, closures, objects holding locks ...
            raise ValueError(
                f"the partitioner {partitioner!r} cannot be sent to a helper process"
                f" ({e}); define it at module level or plan in-process"
            ) from None
        self._pool = ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("forkserver"))

    def __call__(self, partitioner: Partitioner, world: WorldLengths, info: RuntimeInfo) -> Plan:
        # The calling thread blocks on a pipe, without the GIL.
        return self._pool.submit(_partition, partitioner, world, info).result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def plan_in_thread(partitioner: Partitioner, world: WorldLengths, info: RuntimeInfo) -> Plan:
    return partitioner(world, info)
