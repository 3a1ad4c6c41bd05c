"""What every Triton launcher needs: integer word views, sizes, device checks, GB/s."""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from torch import Tensor
from triton.runtime.interpreter import InterpretedFunction

cdiv = triton.cdiv
next_pow2 = triton.next_power_of_2

# Widest integer word that tiles a row: copies never do float arithmetic, so
# every dtype (bf16 included) moves bit-exactly, under the CPU interpreter too.
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


# Sizes that change every step (row counts, ...) are ``do_not_specialize``:
# Triton would otherwise compile a variant the first time such a size is
# divisible by 16 (or equals 1), a ~100 ms stall inside some later step.


# Kernels use only Triton's builtins and the jit helpers of this package, never
# the jit functions of `triton.language.standard` (tl.zeros, tl.sum, ...): those
# are decorated when Triton is first imported, and a library that imports
# Triton before TRITON_INTERPRET is set (TorchRec does) would leave them
# uncallable from interpreted kernels.
@triton.jit
def count_true(mask):
    """Number of true entries in each row of a 2-D boolean block, as int32.

    The reduce builtin with Triton's own sum combine is what ``tl.sum`` lowers
    to; the interpreter recognizes that combine and sums with NumPy (any other
    combine function runs a Python loop per element)."""
    return tl.reduce(mask.to(tl.int32), 1, tl.standard._sum_combine)


@triton.jit
def count(mask):
    """Number of true entries of a 1-D boolean block, as int64 (``tl.sum``'s
    reduction, written with builtins for the reason above)."""
    return tl.reduce(mask.to(tl.int64), 0, tl.standard._sum_combine)


@triton.jit
def row_max(x):
    """Maximum of each row of a 2-D float block (``tl.max(x, 1)`` in builtins; the
    interpreter reduces this combine with NumPy too)."""
    return tl.reduce(x, 1, tl.standard._elementwise_max)


@triton.jit
def row_sum(x):
    """Sum of each row of a 2-D float block (``tl.sum(x, 1)`` in builtins)."""
    return tl.reduce(x, 1, tl.standard._sum_combine)


@triton.jit
def copy_rows(src, dst, src_rows, dst_rows, mask, W, BLOCK_W: tl.constexpr):
    """``dst[dst_rows, :W] = src[src_rows, :W]`` where ``mask`` (rows of ``W`` words)."""
    for w0 in range(0, W, BLOCK_W):
        cols = w0 + tl.arange(0, BLOCK_W)
        m = mask[:, None] & (cols < W)[None, :]
        v = tl.load(src + src_rows[:, None] * W + cols[None, :], mask=m)
        tl.store(dst + dst_rows[:, None] * W + cols[None, :], v, mask=m)


def tile(words: int) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_W) for rows of ``words`` words: about 2K words per tile."""
    block_w = min(next_pow2(max(words, 1)), 128)
    return max(1, min(1024, 2048 // block_w)), block_w


def as_words(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Each tensor as a ``[rows, words]`` integer view of its bytes (no copy).

    The tensors must be contiguous with equal row widths in bytes; they get the
    widest integer word that divides the row and every data pointer.
    """
    views = []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError("as_words needs contiguous tensors")
        width = 1
        for size in t.shape[1:]:
            width *= size
        views.append(t.reshape(t.shape[0], width).view(torch.uint8))
    nbytes = views[0].shape[1]
    dtype = next(
        d for w, d in _WORDS if nbytes % w == 0 and all(v.data_ptr() % w == 0 for v in views)
    )
    return tuple(v.view(dtype) for v in views)


def check_launchable(kernel: Callable, device: torch.device) -> None:
    """Compiled kernels need CUDA; interpreted ones (TRITON_INTERPRET=1 when
    Triton was first imported) run on CPU tensors."""
    if device.type != "cuda" and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"the Triton path needs CUDA tensors, got {device}; to run it on CPU set "
            "TRITON_INTERPRET=1 before freescale's Triton kernels are first imported"
        )


def interpreted(kernel: object) -> bool:
    """Whether ``kernel`` runs under the CPU interpreter (TRITON_INTERPRET=1)."""
    return isinstance(kernel, InterpretedFunction)


def search_steps(n: int) -> int:
    """Iterations of a vectorized binary search over ``n`` sorted entries."""
    return max(1, int(n).bit_length())


def bench_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn`` on the current CUDA device (``warmup`` and
    ``rep`` in ms, as `do_bench` takes them)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def gbps(nbytes: int, ms: float) -> float:
    """Achieved bandwidth in GB/s (1e9 bytes per second)."""
    return nbytes / (ms * 1e-3) / 1e9
