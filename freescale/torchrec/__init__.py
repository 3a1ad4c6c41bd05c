"""TorchRec interop (layer 3): keep TorchRec's loop, optimizer and pipelines.

- `freescale.torchrec.fused_optimizer`: `FusedOptimizer(collection)`, the
  in-backward update as a ``torch.optim.Optimizer``; `from_fused_params`,
  `set_gradient_division` for TorchRec's numbers.
- `freescale.torchrec.pipeline`: the load balancer in front of TorchRec's
  training pipelines (`KJTBatch`, `balance_stage`, `balanced_batches`).

The KJT converters are `freescale.jagged.interop`'s; `swap` (in
`freescale.embedding`) replaces TorchRec ``EmbeddingCollection`` modules.
TorchRec itself is imported only where its types are built (`docs/torchrec.md`).
"""
