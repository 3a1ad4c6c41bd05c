"""Explicit gradient scaling for sharded embeddings.

The rule: **normalize the loss by the global count of the step** (samples or
candidates summed over all ranks), never by the local count and never by the
world size. Then

    loss = sum over all ranks r, items i of l(r, i) / N_global

and the gradient that reaches every embedding row is the same no matter how
the N_global items were split across ranks (the sharded lookup adds the
per-rank contributions; nothing divides them by W). This is what keeps the
update unchanged when the load balancer moves samples between ranks and
changes local batch sizes.

Dense parameters replicated with DDP are averaged over ranks by DDP (a
division by W); with a loss normalized by N_global, multiply the dense
gradients by W (or use a sum-reducing all-reduce) to get the same math. The
sharded embeddings never need such a correction.
"""

from __future__ import annotations

import torch

from freescale.comm import Communicator


def global_count(comm: Communicator, local_count: int) -> int:
    """Sum of ``local_count`` over all ranks (one small all_gather)."""
    x = torch.tensor([int(local_count)], dtype=torch.int64, device=comm.device)
    return int(comm.all_gather(x).wait().sum())
