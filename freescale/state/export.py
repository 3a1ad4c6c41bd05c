"""The trained model as its author wrote it: one full, unsharded state dict.

Training swaps a model's embedding modules for sharded drop-ins
(`freescale.embedding.swap`). `full_state_dict` gathers every table from
its owners and lays it under the key the *plain* module has
(``<path>.weight`` of an ``nn.Embedding``, ``<path>.embeddings.<table>.weight``
of a TorchRec ``EmbeddingCollection``), beside the dense weights, so that
``plain_model.load_state_dict(state)`` loads it into the model the factory
builds. A collective: every rank calls it; rank 0 gets the dict.

A dynamic table (`freescale.embedding.dynamic`) has no row order: under the
same key it gives the rows of the ids it holds, by id, with ``<path>.ids``
(int64, ascending) and ``<path>.optimizer.<state>`` (each id's optimizer
state) beside it (``<path>`` the key without its ``weight``); a plain
``nn.Embedding`` does not load them as they are.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch.distributed as dist
from torch import Tensor, nn

from freescale.embedding.collection import ShardedEmbeddingCollection
from freescale.embedding.swap import ShardedEmbedding, ShardedTorchRecCollection


def plain_table_keys(swapped: Mapping[str, nn.Module]) -> dict[str, str]:
    """``{plain model's state-dict key: collection table}`` of the swapped modules."""
    keys: dict[str, str] = {}
    for path, module in swapped.items():
        if isinstance(module, ShardedEmbedding):
            keys[f"{path}.weight"] = module.table
        elif isinstance(module, ShardedTorchRecCollection):
            for name, table in module.table_names().items():
                keys[f"{path}.embeddings.{name}.weight"] = table
        else:
            raise TypeError(f"{path}: {type(module).__name__} is not a swapped embedding module")
    return keys


def full_state_dict(
    model: nn.Module, collection: ShardedEmbeddingCollection, swapped: Mapping[str, nn.Module]
) -> dict[str, Tensor] | None:
    """The plain model's state dict on rank 0 (None on the others), on the CPU."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    tables: dict[str, Tensor] = {}
    for key, t in plain_table_keys(swapped).items():
        if collection.tables[t].dynamic is None:
            tables[key] = collection.full_table(t)
            continue
        ids, rows, state = collection.dynamic_rows(t)
        head = key.removesuffix("weight")
        tables.update({key: rows, f"{head}ids": ids})
        tables.update({f"{head}optimizer.{k}": v for k, v in state.items()})
    if rank != 0:
        return None
    with collection.tables_left_out():
        dense = model.state_dict()
    state = {k: v.detach().cpu().clone() for k, v in dense.items()}
    state.update({k: v.detach().cpu() for k, v in tables.items()})
    return state
