"""Embedding state on disk and in ``state_dict()`` (part of `freescale.embedding`).

- `checkpoint`: ``save`` / ``load`` of the sharded tables and optimizer state
  with ``torch.distributed.checkpoint``, `TableEntries` (resharding form)
  and `WeightCopies` (copies of the rows, the same form);
- `state_dict`: tables and optimizer state as contiguous row chunks
  (``DTensor`` ``Shard(0)``), what a swapped model's ``state_dict()`` holds;
- `dynamic_entries`: a dynamic table's rows keyed by id, with its map;
- `dcp_safe`: reading a DCP directory without running code from it.

The public names are re-exported by `freescale.embedding`; nothing is
imported here.
"""
