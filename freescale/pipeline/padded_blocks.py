"""The dense block stack over inputs padded to a bucket of sizes: what a CUDA
graph captures (`freescale.pipeline.graphs`), and its eager twin.

A bucket rounds the UIH rows up in 1/8-octave steps, the candidate rows to a
power of two and the sample count to a multiple of 8, so a few shapes serve
every step. Padding rows lie outside every attention segment; their outputs
are masked to 0 and their gradients zeroed (the module docstring of
`freescale.pipeline.graphs` says why).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from freescale.jagged.ops import side_stream
from freescale.kernels.linear import graph_body
from freescale.models.attention import AttentionLayout, Segments

SIZES_PER_OCTAVE = 8


def bucket(n: int) -> int:
    """Smallest ``m * 2**e >= n`` with ``8 <= m <= 16``: at most 1/8 padding
    (``n`` itself below 16)."""
    if n <= 2 * SIZES_PER_OCTAVE:
        return max(n, 1)
    shift = n.bit_length() - SIZES_PER_OCTAVE.bit_length()
    return -(-n // (1 << shift)) << shift


def pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class Bucket:
    """One padded shape: what a graph is captured for. The attention maxima
    are not part of it: a graph captured for longer segments serves shorter
    ones (the flash grid is only larger than needed)."""

    tokens: int  # UIH rows (real + padding): 1/8 steps
    candidates: int  # a power of two, at least the largest seen: these rows are cheap
    segments: int  # samples rounded up to 8 (the rest empty), at least the most seen
    dtype: torch.dtype
    amp: torch.dtype | None  # autocast dtype at capture (None: autocast off)

    @staticmethod
    def of(
        n_u: int, n_c: int, samples: int, dtype: torch.dtype, amp: torch.dtype | None = None,
        min_candidates: int = 0, min_segments: int = 0,
    ) -> Bucket:  # fmt: skip
        """``min_*``: floors (the largest seen so far), so these two sizes stop
        multiplying the number of graphs after the first steps."""
        segments = max(-(-max(samples, 1) // 8) * 8, min_segments)
        return Bucket(bucket(n_u), max(pow2(n_c), min_candidates), segments, dtype, amp)


def padded_offsets(
    uih_offsets: Tensor, cand_offsets: Tensor, n_u: int, n_c: int, b: Bucket
) -> tuple[Tensor, Tensor]:
    """int32 boundaries [segments + 1]: the samples, then empty ones. Padding
    rows (``n_u..tokens``) lie in no segment. Built on the device: no read-back."""
    out = []
    for offsets, n in ((uih_offsets, n_u), (cand_offsets, n_c)):
        cu = torch.empty(b.segments + 1, dtype=torch.int32, device=offsets.device)
        write_padded(cu, offsets, n)
        out.append(cu)
    return out[0], out[1]


def write_padded(cu: Tensor, offsets: Tensor, n: int) -> None:
    """``cu`` (int32) = ``offsets``, then ``n`` for each empty segment after them.
    A replay writes its graph's static boundaries so, in place: two kernels."""
    cu[: offsets.numel()].copy_(offsets)
    cu[offsets.numel() :].fill_(n)


def _segment_masks(cu_u: Tensor, cu_c: Tensor, tokens: int, cands: int) -> tuple[Tensor, ...]:
    """[rows, 1, 1] bool masks, on the device: UIH padding, candidate padding,
    and candidates without keys (an empty UIH, or padding)."""
    rows_u = torch.arange(tokens, device=cu_u.device, dtype=torch.int32)
    rows_c = torch.arange(cands, device=cu_c.device, dtype=torch.int32)
    pad_u, pad_c = rows_u >= cu_u[-1], rows_c >= cu_c[-1]
    # Padding candidates fall after the last boundary: segment index = #segments,
    # whose key count is the appended 0.
    k_len = torch.cat([cu_u[1:] - cu_u[:-1], cu_u.new_zeros(1)])
    owner = torch.searchsorted(cu_c, rows_c, right=True) - 1
    no_keys = k_len[owner] == 0
    return pad_u[:, None, None], pad_c[:, None, None], no_keys[:, None, None]


def _side_stream() -> torch.cuda.Stream:
    """The candidate path's stream (`run_blocks`), one per device."""
    return side_stream("graph candidates")


class PaddedBlocks(nn.Module):
    """The block stack over padded inputs: the body a graph captures.

    Runs eagerly too (on the CPU with the reference attention), which is how
    the padding is tested against the unpadded stack."""

    def __init__(
        self, blocks: nn.ModuleList, max_uih: int, max_candidates: int, impl: str | None = None,
        two_streams: bool = True,
    ) -> None:  # fmt: skip
        super().__init__()
        self.blocks = blocks
        self.max_uih, self.max_candidates = max_uih, max_candidates
        self.impl = impl  # None: varlen on CUDA, reference elsewhere
        self.two_streams = two_streams  # on CUDA: the candidate path on a side stream

    def forward(self, uih: Tensor, cand: Tensor, cu_u: Tensor, cu_c: Tensor) -> Tensor:
        """The candidates' output [candidates, dim] (the UIH output has no reader)."""
        impl = self.impl or ("varlen" if uih.is_cuda else "reference")
        bounds_u = cu_u.tolist() if impl == "reference" else None
        bounds_c = cu_c.tolist() if impl == "reference" else None
        su = Segments(cu_u, cu=cu_u, max_len=self.max_uih, bounds=bounds_u)
        sc = Segments(cu_c, cu=cu_c, max_len=self.max_candidates, bounds=bounds_c)
        pad_u, pad_c, no_keys = _segment_masks(cu_u, cu_c, uih.shape[0], cand.shape[0])
        layout = (
            AttentionLayout(impl, su, su, True, pad_u, q_pad=pad_u, k_pad=pad_u),
            AttentionLayout(impl, sc, su, False, no_keys, q_pad=pad_c, k_pad=pad_u),
        )
        side = _side_stream() if uih.is_cuda and self.two_streams else None
        with graph_body():  # the blocks' bias gradients without memset nodes
            return run_blocks(self.blocks, uih, cand, layout, side)


def run_blocks(
    blocks: nn.ModuleList,
    uih: Tensor,
    cand: Tensor,
    layout: tuple[AttentionLayout, AttentionLayout],
    side: torch.cuda.Stream | None = None,
) -> Tensor:
    """The candidates' output of the stack; with ``side`` (CUDA) their path on it.

    The candidate rows are few (one per candidate, vs thousands of UIH rows),
    so on a side stream their small kernels mostly run in the gaps between
    the UIH path's: the GPU idles less. In backward, autograd runs each op's
    gradient on the stream of its forward, so the overlap holds there too.
    Every tensor the side stream reads from the current one is recorded on
    it, so the allocator (also while capturing a graph) does not hand its
    memory out early.
    """
    main = torch.cuda.current_stream() if side is not None else None
    if side is not None:
        side.wait_stream(main)
        for t in (cand, *layout[0].tensors(), *layout[1].tensors()):
            t.record_stream(side)
    last = len(blocks) - 1
    for i, block in enumerate(blocks):
        uih, cand = _block(block, uih, cand, layout, i < last, side)
    if main is not None:
        main.wait_stream(side)
        cand.record_stream(main)
    return cand


def _block(
    block: nn.Module,
    uih: Tensor,
    cand: Tensor,
    layout: tuple[AttentionLayout, AttentionLayout],
    uih_out: bool,
    side: torch.cuda.Stream | None,
) -> tuple[Tensor, Tensor]:
    """``block(uih, cand, layout, uih_out)`` with its candidate path on ``side``:
    the same calls in the same order as `Block.forward`, so the same kernels
    and numbers. The caller forks ``side`` before the first block and joins
    it after the last (`run_blocks`)."""
    if side is None:
        return block(uih, cand, layout, uih_out=uih_out)
    with torch.cuda.stream(side):
        qc = block.cand_query(cand)
    qu, ku, vu = block.uih_qkv(uih)
    side.wait_stream(torch.cuda.current_stream())  # the keys and values
    # Their memory (one storage: the qkv output) must not be reused until the
    # side stream is done with it (the cross-attention saves them for backward).
    ku.record_stream(side)
    with torch.cuda.stream(side):
        cand = block.cand_update(cand, qc, ku, vu, layout[1])
    if uih_out:
        uih = block.uih_update(uih, qu, ku, vu, layout[0])
    return uih, cand


def pad_rows(x: Tensor, rows: int) -> Tensor:
    return torch.nn.functional.pad(x, (0, 0, 0, rows - x.shape[0]))


def padded_inputs(
    uih: Tensor, cand: Tensor, uih_offsets: Tensor, cand_offsets: Tensor
) -> tuple[Bucket, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """The bucket of a step and its padded `PaddedBlocks` arguments (eager)."""
    n_u, n_c = uih.shape[0], cand.shape[0]
    b = Bucket.of(n_u, n_c, uih_offsets.numel() - 1, uih.dtype)
    cu_u, cu_c = padded_offsets(uih_offsets, cand_offsets, n_u, n_c, b)
    return b, (pad_rows(uih, b.tokens), pad_rows(cand, b.candidates), cu_u, cu_c)
