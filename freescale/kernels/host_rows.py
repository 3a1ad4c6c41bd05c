"""Row gathers from host memory into device memory, and their torch twins.

A host-tier table (`freescale.embedding.host_tier`) keeps its rows in pinned
host memory. Pinned memory is mapped into every GPU's address space (UVA), so
a kernel given its pointer reads the rows over PCIe directly: only the rows
asked for cross the bus, never the whole table, and no staging copy on the
host is needed. On CUDA the Triton row mover (`triton_host_rows`) does that;
the torch twin (the CPU path, and the reference) is ``index_select`` on the
host followed by a copy to the device, bit-identical because rows move as
they are.

- ``gather_host_rows(host, index, device)``: ``host[index]`` on ``device``.
- ``refresh_host_rows(host, index, mask, out)``: ``out[j] = host[index[j]]``
  where ``mask[j]``; the other rows of ``out`` stay. It re-reads rows that
  changed in the host table since ``out`` was gathered (the prefetch's
  collision rows): a mask, not a compacted index, so nothing is read back to
  the host to size it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from freescale.kernels.backend import choose_impl, triton_module


def gather_host_rows(
    host: Tensor, index: Tensor, device: torch.device, *, impl: str | None = None
) -> Tensor:
    """``host[index]`` as a new tensor on ``device`` (``index`` on ``device``)."""
    if choose_impl(impl, device) == "triton":
        return triton_module("host_rows").gather_host_rows(host, index)
    rows = host.index_select(0, index.to(host.device))
    return rows.to(device)


def refresh_host_rows(
    host: Tensor, index: Tensor, mask: Tensor, out: Tensor, *, impl: str | None = None
) -> None:
    """``out[mask] = host[index[mask]]`` in place (``index``, ``mask``, ``out`` on one device)."""
    if choose_impl(impl, out.device) == "triton":
        triton_module("host_rows").refresh_host_rows(host, index, mask, out)
        return
    where = mask.nonzero().squeeze(1)
    rows = host.index_select(0, index.index_select(0, where).to(host.device))
    out.index_copy_(0, where, rows.to(out.device))
