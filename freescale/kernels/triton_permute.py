"""Triton indexed permute; keyed transpose is the same kernel with a computed index.

Reference: `freescale.kernels.permute.indexed_permute_reference`: output
segment ``i`` is input segment ``indices[i]``, for every feature.

Two layouts, chosen on the host from the mean output segment length:

- element-parallel (short segments): a program owns ``BLOCK_R`` output rows and
  finds each row's segment by a vectorized binary search over the output
  offsets, so every program does the same work however skewed the lengths;
- segment-parallel (long segments): a 2-D grid (segment, chunk) whose
  ``CHUNKS`` programs stride over one segment: no search, contiguous copies,
  and a segment several times the mean is shared instead of stalling one program.

Rows move as integer words (`triton_common.as_words`); all features with the same
word shape go in one launch (a tuple of pointers), so the index math is done
once for all of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from freescale.jagged import ops
from freescale.jagged.tensor import JaggedFeatures
from freescale.kernels.permute import indexed_permute_reference, permute_bytes
from freescale.kernels.triton_common import (
    as_words,
    bench_ms,
    cdiv,
    check_launchable,
    copy_rows,
    gbps,
    search_steps,
    tile,
)

MODE_INDEXED = 0  # source segment = indices[seg]
MODE_TRANSPOSE = 1  # source segment of a row-major [R, C] grid read as [C, R]
SEGMENT_MIN_WORDS = 128  # mean words per segment from which segment-parallel wins
MAX_CHUNKS = 64


# ---- kernels --------------------------------------------------------------
@triton.jit
def _source_segment(seg, indices, mask, R, C, MODE: tl.constexpr):
    """Input segment that output segment ``seg`` copies."""
    if MODE == 0:
        return tl.load(indices + seg, mask=mask, other=0)
    return (seg % R) * C + seg // R


@triton.jit
def _copy_features(srcs, dsts, src_rows, dst_rows, mask, W, BLOCK_W: tl.constexpr):
    """Copy the same rows of every feature (tuples of word pointers)."""
    for f in tl.static_range(len(srcs)):
        copy_rows(srcs[f], dsts[f], src_rows, dst_rows, mask, W, BLOCK_W)


@triton.jit(do_not_specialize=["n_segs", "total", "n_steps"])
def _permute_rows_kernel(src_offsets, dst_offsets, indices, n_segs, total, n_steps, R, C, W,
                         srcs, dsts, MODE: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK_W: tl.constexpr):  # fmt: skip
    """Element-parallel: one program per ``BLOCK_R`` output rows."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = rows < total
    # largest seg with dst_offsets[seg] <= row (skips empty segments)
    lo = tl.full([BLOCK_R], 0, tl.int64)
    hi = lo + n_segs
    for _ in range(n_steps):
        mid = (lo + hi) >> 1
        right = tl.load(dst_offsets + mid) <= rows
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    src_seg = _source_segment(lo, indices, mask, R, C, MODE)
    src_rows = tl.load(src_offsets + src_seg, mask=mask, other=0)
    src_rows += rows - tl.load(dst_offsets + lo)
    _copy_features(srcs, dsts, src_rows, rows, mask, W, BLOCK_W)


@triton.jit(do_not_specialize=["n_segs", "total", "n_steps"])
def _permute_segments_kernel(src_offsets, dst_offsets, indices, n_segs, total, n_steps, R, C,
                             W, srcs, dsts, MODE: tl.constexpr, BLOCK_R: tl.constexpr,
                             BLOCK_W: tl.constexpr):  # fmt: skip
    """Segment-parallel: program (seg, chunk) copies chunks chunk, chunk + CHUNKS, ..."""
    seg = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    dst_start = tl.load(dst_offsets + seg)
    length = tl.load(dst_offsets + seg + 1) - dst_start
    src_start = tl.load(src_offsets + _source_segment(seg, indices, seg < n_segs, R, C, MODE))
    step = tl.num_programs(1).to(tl.int64) * BLOCK_R
    for r0 in range(chunk * BLOCK_R, length, step):
        r = r0 + tl.arange(0, BLOCK_R)
        _copy_features(srcs, dsts, src_start + r, dst_start + r, r < length, W, BLOCK_W)


# ---- launcher -------------------------------------------------------------
def indexed_permute_triton(
    feats: JaggedFeatures,
    indices: Tensor,
    total: int | None = None,
    *,
    layout: str | None = None,
    block_rows: int | None = None,
) -> JaggedFeatures:
    """Triton twin of `indexed_permute_reference` (``layout``/``block_rows`` for tests)."""
    offsets = feats.offsets
    indices = indices.to(device=offsets.device, dtype=torch.int64)
    new_offsets = ops.lengths_to_offsets(ops.offsets_to_lengths(offsets)[indices])
    if total is None:
        total = int(new_offsets[-1])
    out = {n: t.new_empty((total, *t.shape[1:])) for n, t in feats.features.items()}
    copy = (feats.features, out, offsets, new_offsets, indices, total)
    launch_permute(*copy, mode=MODE_INDEXED, layout=layout, block_rows=block_rows)
    return JaggedFeatures(new_offsets, out)


def keyed_transpose_triton(
    feats: JaggedFeatures, rows: int, cols: int, *, layout: str | None = None
) -> JaggedFeatures:
    """Segments of a row-major ``[rows, cols]`` grid re-laid as ``[cols, rows]``."""
    offsets = feats.offsets
    lengths = ops.offsets_to_lengths(offsets).view(rows, cols).t().reshape(-1)
    new_offsets = ops.lengths_to_offsets(lengths)
    first = next(iter(feats.features.values()), None)
    total = first.shape[0] if first is not None else int(offsets[-1])
    out = {n: t.new_empty(t.shape) for n, t in feats.features.items()}
    copy = (feats.features, out, offsets, new_offsets, offsets, total)  # indices unused
    launch_permute(*copy, mode=MODE_TRANSPOSE, grid=(rows, cols), layout=layout)
    return JaggedFeatures(new_offsets, out)


def launch_permute(
    src: dict[str, Tensor],
    dst: dict[str, Tensor],
    src_offsets: Tensor,
    dst_offsets: Tensor,
    indices: Tensor,
    total: int,
    *,
    mode: int,
    grid: tuple[int, int] = (1, 1),
    layout: str | None = None,
    block_rows: int | None = None,
) -> None:
    """Copy every feature of ``src`` into ``dst``: one launch per word shape.
    ``grid`` is the ``[R, C]`` segment grid of a transpose (unused when indexed)."""
    R, C = grid
    n_segs = dst_offsets.numel() - 1
    if total == 0 or n_segs == 0:
        return
    check_launchable(_permute_rows_kernel, src_offsets.device)
    groups: dict[tuple[torch.dtype, int], tuple[list[Tensor], list[Tensor]]] = {}
    for name, t in src.items():
        s, d = as_words(t.contiguous(), dst[name])
        if s.shape[1]:
            srcs, dsts = groups.setdefault((s.dtype, s.shape[1]), ([], []))
            srcs.append(s)
            dsts.append(d)
    for (_, W), (srcs, dsts) in groups.items():
        BLOCK_R, BLOCK_W = tile(W)
        BLOCK_R = block_rows or BLOCK_R
        segmented = layout == "segment" or (
            layout is None and total * W >= SEGMENT_MIN_WORDS * n_segs
        )
        if segmented:
            chunks = min(MAX_CHUNKS, max(1, cdiv(cdiv(total, n_segs), BLOCK_R)))
            kernel, programs = _permute_segments_kernel, (n_segs, chunks)
        else:
            kernel, programs = _permute_rows_kernel, (cdiv(total, BLOCK_R),)
        steps = search_steps(n_segs)
        kernel[programs](src_offsets, dst_offsets, indices, n_segs, total, steps, R, C, W,
                         tuple(srcs), tuple(dsts), MODE=mode, BLOCK_R=BLOCK_R,
                         BLOCK_W=BLOCK_W)  # fmt: skip


# ---- check and GB/s -------------------------------------------------------
def random_case(
    num_segments: int, mean_length: int, device: str, seed: int = 0
) -> tuple[JaggedFeatures, Tensor]:
    """Skewed lengths (0 .. 4x mean), three int64 features, a random selection."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 2 * mean_length + 1, (num_segments,), generator=g)
    lengths[torch.randint(0, num_segments, (max(1, num_segments // 100),), generator=g)] *= 2
    total = int(lengths.sum())
    feats = JaggedFeatures(
        ops.lengths_to_offsets(lengths),
        {n: torch.randint(0, 2**40, (total,), generator=g) for n in ("ids", "actions", "ts")},
    )
    indices = torch.randperm(num_segments, generator=g)[: max(1, num_segments // 2)]
    return feats.map(lambda t: t.to(device)), indices.to(device)


def check(device: str = "cuda", num_segments: int = 1000, mean_length: int = 50) -> None:
    """Both layouts against the reference on a random case (raises on mismatch)."""
    feats, indices = random_case(num_segments, mean_length, device)
    expected = indexed_permute_reference(feats, indices)
    for layout in ("rows", "segment"):
        got = indexed_permute_triton(feats, indices, int(expected.offsets[-1]), layout=layout)
        assert got.equal(expected), f"indexed permute ({layout}) differs from the reference"


def bench(num_segments: int = 8192, mean_length: int = 4000) -> dict[str, float]:
    """Milliseconds and GB/s of the kernel and the reference on CUDA."""
    feats, indices = random_case(num_segments, mean_length, "cuda")
    total = int(ops.offsets_to_lengths(feats.offsets)[indices].sum())
    nbytes = permute_bytes(feats, indices.numel(), total)
    ms = bench_ms(lambda: indexed_permute_triton(feats, indices, total))
    ref_ms = bench_ms(lambda: indexed_permute_reference(feats, indices, total))
    return {"ms": ms, "torch_ms": ref_ms, "gbps": gbps(nbytes, ms)}


if __name__ == "__main__":
    check()
    print(bench())
