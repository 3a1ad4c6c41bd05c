"""Row -> (owner rank, local slot) assignment of one row-wise sharded table.

The assignment is `freescale.kernels.shard.RowSharding`, the one the dispatch
kernels route ids with; it is re-exported here, where the embedding's plan
names it.
"""

from freescale.kernels.shard import RowSharding, stripe_hash

__all__ = ["RowSharding", "stripe_hash"]
