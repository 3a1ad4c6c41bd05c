"""Row-wise sharded embeddings (layer 2): the synchronous ("vanilla TorchRec") baseline.

- `TableConfig`, `ShardingPlan`: what to shard and how (`freescale.embedding.config`);
  `DynamicSpec`: a dynamic table, any int64 id in bounded rows (`freescale.embedding.dynamic`).
- `ShardedEmbeddingCollection`: sharded lookup with the optimizer update fused
  into backward, in the mode given at construction (`freescale.embedding.modes`):
  `Sync`, `SparseDataDist` (prefetch) or `Prioritized` (paper Algorithm 2).
- `SGD`, `RowwiseAdagrad`, `Adam`: sparse row-wise optimizers.
- `swap(model, plan)`: replace ``nn.Embedding`` / TorchRec ``EmbeddingCollection``.
- `save` / `load`: ``torch.distributed.checkpoint`` of shards and optimizer state;
  `TableEntries(collection)`: the same as entries any world size loads.
- `global_count`: the explicit gradient-scaling rule (`freescale.embedding.scaling`).
"""

from freescale.embedding.collection import ShardedEmbeddingCollection
from freescale.embedding.config import ShardingPlan, TableConfig
from freescale.embedding.dynamic import DynamicSpec
from freescale.embedding.modes import Mode, Prioritized, SparseDataDist, Sync
from freescale.embedding.optim import SGD, Adam, OptimizerConfig, RowwiseAdagrad
from freescale.embedding.scaling import global_count
from freescale.embedding.state.checkpoint import TableEntries, load, save
from freescale.embedding.swap import ShardedEmbedding, ShardedTorchRecCollection, swap
from freescale.kernels.shard import RowSharding

__all__ = [
    "SGD",
    "Adam",
    "DynamicSpec",
    "Mode",
    "OptimizerConfig",
    "Prioritized",
    "RowSharding",
    "RowwiseAdagrad",
    "ShardedEmbedding",
    "ShardedEmbeddingCollection",
    "ShardedTorchRecCollection",
    "ShardingPlan",
    "SparseDataDist",
    "Sync",
    "TableConfig",
    "TableEntries",
    "global_count",
    "load",
    "save",
    "swap",
]
