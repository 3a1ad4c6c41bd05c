"""Triton gathers of host-memory rows into device memory (zero-copy over PCIe).

Reference: `freescale.kernels.host_rows` (``index_select`` on the host, then a
copy). The kernel is the row mover of `triton_rows` with a mask: a program
moves a ``[BLOCK_R, BLOCK_W]`` tile of integer words, so a 512-byte row is one
read burst over PCIe. The source is a *host* tensor: pinned memory, whose
pointer the GPU can dereference (UVA; `freescale.embedding.host_tier`
allocates it so). Rows move as words, so every dtype is copied bit-exactly.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freescale.kernels.triton_common import as_words, cdiv, check_launchable, copy_rows, tile


# ---- kernel ---------------------------------------------------------------
@triton.jit(do_not_specialize=["n"])
def _host_rows_kernel(
    src, dst, index, keep, n, W, MASKED: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = rows < n
    if MASKED:  # only the rows whose flag is set (bytes: no i1 pointer)
        mask = mask & (tl.load(keep + rows, mask=mask, other=0) != 0)
    other = tl.load(index + rows, mask=mask, other=0)
    copy_rows(src, dst, other, rows, mask, W, BLOCK_W)


# ---- launchers ------------------------------------------------------------
def gather_host_rows(host: Tensor, index: Tensor) -> Tensor:
    """``host[index]`` on ``index``'s device; ``host`` must be pinned (or on that device)."""
    out = torch.empty((index.shape[0], *host.shape[1:]), dtype=host.dtype, device=index.device)
    _launch(host, out, index, None)
    return out


def refresh_host_rows(host: Tensor, index: Tensor, mask: Tensor, out: Tensor) -> None:
    """``out[j] = host[index[j]]`` where ``mask[j]``, in place."""
    _launch(host, out, index, mask.view(torch.uint8))


def _launch(host: Tensor, out: Tensor, index: Tensor, keep: Tensor | None) -> None:
    n = index.shape[0]
    s, d = as_words(host, out)
    W = s.shape[1]
    if n == 0 or W == 0:
        return
    check_launchable(_host_rows_kernel, out.device)
    BLOCK_R, BLOCK_W = tile(W)
    idx = index.to(torch.int64)
    _host_rows_kernel[(cdiv(n, BLOCK_R),)](
        s, d, idx, idx if keep is None else keep, n, W,
        MASKED=keep is not None, BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W,
    )  # fmt: skip
