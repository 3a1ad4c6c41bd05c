"""Jagged attention kernels (layer 1, part of `freescale.kernels`): each op runs
on the packed rows of a batch, with a torch twin for the CPU and for tests.

- `hstu`: the fused HSTU attention (pointwise SiLU, relative bias), launching
  the Triton kernels of `triton_hstu_fwd` / `triton_hstu_bwd` (their shared
  pieces: `triton_hstu_tiles`);
- `cross`: candidate -> history cross-attention (plan, twin, dispatch), Triton
  kernel in `triton_cross`;
- `cudnn_sdpa`: the optional causal self-attention on cuDNN's SDPA graphs,
  declared in `cudnn_graphs`.

Nothing is imported here, so ``import freescale.kernels.attention`` stays
cheap; Triton is imported by `freescale.kernels.backend.triton_module` alone.
"""
