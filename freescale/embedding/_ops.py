"""Index helpers of the sharded lookup, in vectorized torch.

Routing (dispatch/combine) uses `freescale.kernels`; these are the
duplicate-row sums of the update and the input check. All are deterministic.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Longest run one thread of ``segment_reduce`` adds sequentially; longer
# segments (hot rows) are cut into chunks whose sums are added level by level.
CHUNK = 32


def segment_sum(x: Tensor, lengths: Tensor, chunk: int | None = CHUNK) -> Tensor:
    """Sum consecutive segments of ``x`` (all lengths >= 1) in a fixed order.

    With ``chunk``, each segment is cut into chunks of ``chunk`` rows added
    sequentially, then the chunk sums are summed the same way, until one value
    per segment is left: on a GPU a hot row of a million duplicates then costs
    a few levels of short sequential sums instead of one million-step loop in
    one thread. ``chunk=None`` adds each segment sequentially in one pass (the
    CPU choice: there the per-level cost is per segment, not per row). Either
    way the order depends only on the lengths: results are bitwise reproducible.
    """
    while chunk is not None and int(lengths.max()) > chunk:
        chunks = torch.div(lengths + chunk - 1, chunk, rounding_mode="floor")
        total = int(chunks.sum())
        seg = torch.repeat_interleave(
            torch.arange(lengths.numel(), device=x.device), chunks, output_size=total
        )
        first = torch.cumsum(chunks, 0) - chunks
        k = torch.arange(total, device=x.device) - first[seg]
        chunk_len = (lengths[seg] - k * chunk).clamp_(max=chunk)
        x = torch.segment_reduce(x, "sum", lengths=chunk_len, axis=0)
        lengths = chunks
    return torch.segment_reduce(x, "sum", lengths=lengths, axis=0)


def sum_duplicates(rows: Tensor, grads: Tensor) -> tuple[Tensor, Tensor]:
    """Unique rows (ascending) and fp32 gradient sums, in a fixed deterministic order.

    A stable sort keeps duplicates in the order they arrived (source rank,
    then the sender's batch order); `segment_sum` adds them in an order that
    depends only on the duplicate counts (chunked on GPUs, sequential on CPUs;
    the two devices may therefore round differently, each is reproducible).
    """
    if rows.numel() == 0:
        return rows, grads.new_zeros((0, *grads.shape[1:]), dtype=torch.float32)
    sorted_rows, order = torch.sort(rows, stable=True)
    unique, counts = torch.unique_consecutive(sorted_rows, return_counts=True)
    chunk = CHUNK if grads.is_cuda else None
    return unique, segment_sum(grads.index_select(0, order).float(), counts, chunk)


def first_bad(ids: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """(any id outside [0, rows), the first such id) as device scalars; no host sync."""
    bad = (ids < 0) | (ids >= rows)
    # index_select with a device index: plain ``ids[i]`` could read i back to the host.
    first = ids.index_select(0, bad.to(torch.uint8).argmax().reshape(1))[0]
    return bad.any(), first
