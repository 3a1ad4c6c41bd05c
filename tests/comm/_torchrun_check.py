"""Run by `test_smfree_torchrun.py` under torchrun (2 "nodes" x 2 ranks on 127.0.0.1).

Checks that the smfree communicator finds the hosts from torchrun's variables
(2 hosts x 2 local ranks), uses shm inside a host and NIXL between (gloo
without NIXL), and
returns exactly what the torch backend returns. Writes one JSON file per
rank into the folder given as the first argument (the ranks of one launcher
share its stdout, where lines may interleave).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from freescale.comm import make_communicator
from freescale.comm.nixl_support import nixl_installed
from tests.comm._smfree_cases import POOL, compare


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    env = (int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_RANK"]))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, env)
    comm = make_communicator("smfree", "cpu", pool_bytes=POOL)
    same_node = [g for g, e in enumerate(everyone) if e[0] == env[0]]
    facts = {
        "rank": rank,
        "node": env[0],
        "transport": comm.transport.name,
        "shm_peers": sorted(comm.transport.shm.local),
        "same_node": same_node,
        "hierarchical_gather": comm._gather_impl is not None,
    }
    comm.close()
    facts.update(compare("smfree"))
    if nixl_installed():
        facts["nixl"] = compare("smfree-nixl")  # NIXL between every pair
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(facts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
