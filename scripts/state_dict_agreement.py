"""Cost of the rank agreement before a swapped model's ``state_dict()`` (2 gloo ranks, CPU).

Prints, per rank: ms per `rank_agreement.agree` call, and min / median ms of
``state_dict()`` of one row-wise Adagrad table with and without the agreement
(interleaved calls). Run: ``python scripts/state_dict_agreement.py``.
"""

import time

import torch

from freescale.testing import run_ranks

ROWS, DIM, CALLS = 100_000, 64, 10


def _rank() -> dict:
    import torch.distributed as dist
    from torch import nn

    from freescale.comm import TorchCommunicator
    from freescale.embedding import RowwiseAdagrad, ShardingPlan, rank_agreement, swap
    from freescale.embedding.state import state_dict as sd

    for _ in range(20):
        rank_agreement.agree(None, "warm-up")
    dist.barrier()
    t = time.perf_counter()
    for _ in range(200):
        rank_agreement.agree(None, "bench")
    out = {"agree_ms": (time.perf_counter() - t) / 200 * 1e3}
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": nn.Embedding(ROWS, DIM)})
    swap(model, ShardingPlan(optimizer=RowwiseAdagrad(lr=0.1)), TorchCommunicator())
    times: dict[str, list[float]] = {"with": [], "without": []}
    agree = sd.agree
    for mode in ["with", "without"] * CALLS:
        sd.agree = agree if mode == "with" else (lambda group, what: None)
        dist.barrier()
        t = time.perf_counter()
        model.state_dict()
        times[mode].append((time.perf_counter() - t) * 1e3)
    sd.agree = agree
    for mode, ts in times.items():
        out[f"state_dict_{mode}_min_ms"] = min(ts)
        out[f"state_dict_{mode}_median_ms"] = sorted(ts)[len(ts) // 2]
    return out


if __name__ == "__main__":
    for rank, result in enumerate(run_ranks(_rank, 2, timeout=300)):
        print(rank, {k: round(v, 3) for k, v in result.items()})
