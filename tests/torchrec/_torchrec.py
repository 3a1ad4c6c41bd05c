"""TorchRec's own row-wise sharding of a module, as the TorchRec tests build it (CPU, gloo)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def row_wise_dmp(model: nn.Module, path: str, tables: list[str], fused_params: dict) -> Any:
    """``model`` wrapped by TorchRec's ``DistributedModelParallel``, with the
    ``EmbeddingCollection`` at ``path`` sharded row-wise (fused kernel) over
    every rank of the default group."""
    import torch.distributed as dist
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embedding_types import EmbeddingComputeKernel
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
    from torchrec.distributed.types import ShardingEnv
    from torchrec.distributed.types import ShardingPlan as TRPlan

    world = dist.get_world_size()
    sharder = EmbeddingCollectionSharder(fused_params=fused_params)
    plan = construct_module_sharding_plan(
        model.get_submodule(path),
        {t: row_wise(compute_kernel=EmbeddingComputeKernel.FUSED.value) for t in tables},
        sharder=sharder,
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    return DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=TRPlan({path: plan}),
        sharders=[sharder],
    )
