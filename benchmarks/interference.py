"""How much does overlapped communication slow the compute it hides behind? (paper Fig. 10)

Foreground kernels: the reference model's jagged attention (forward +
backward, UIH lengths and hidden dims swept), a bf16 GEMM and a memory-bound
elementwise kernel, each timed alone and then while a background moves the
step's communication volume:

- ``host``: host-staged copies (D2H then H2D through pinned memory on copy
  streams): the SM-free path's data movement, on the copy engines;
- ``smcopy``: the same bytes moved by a copy kernel with a fixed grid of
  ``channels`` programs (a stand-in for NCCL's channels, one CTA each, when
  only one GPU is there);
- ``nccl`` / ``smfree`` (``torchrun`` with 2+ GPUs): the real AllToAll of
  ``bytes`` per rank through NCCL or the `smfree` Communicator, in a loop.

The background is enqueued (or, for the Communicator, looped by a thread)
before the foreground starts and checked to outlast it.

    python -m benchmarks run fig10          # 1 GPU: host, smcopy
    python -m benchmarks run fig10-nccl     # torchrun, 2 GPUs: + nccl, smfree
    python -m benchmarks run fig10 --smoke  # 2 gloo ranks on the CPU: nccl, smfree

On the CPU (``nccl`` then names torch.distributed's own AllToAll on gloo) the
run checks the plumbing; its times say nothing about a GPU.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.distributed as dist

from .runner import Ctx, Result
from .scenario import Scenario

Fn = Callable[[], None]
DEVICE = "cuda"  # --device


def _dtype() -> torch.dtype:
    return torch.bfloat16 if DEVICE == "cuda" else torch.float32


def time_ms(fn: Fn, reps: int) -> float:
    """Median of ``reps`` event-timed calls (after 3 warm-ups)."""
    for _ in range(3):
        fn()
    if DEVICE == "cpu":
        return _time_ms_host(fn, reps)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _time_ms_host(fn: Fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


# ---- foreground ---------------------------------------------------------------
def attention(uih: int, dim: int, total_tokens: int) -> Fn:
    from freescale.models.attention import jagged_attention

    heads = max(1, dim // 64)
    n = max(1, total_tokens // uih)
    offsets = torch.arange(0, (n + 1) * uih, uih, device=DEVICE, dtype=torch.int64)
    q, k, v = (
        torch.randn(n * uih, heads, dim // heads, device=DEVICE, dtype=_dtype(),
                    requires_grad=True)
        for _ in range(3)
    )  # fmt: skip
    grad = torch.randn(n * uih, heads, dim // heads, device=DEVICE, dtype=_dtype())
    impl = "varlen" if DEVICE == "cuda" else "reference"

    def run() -> None:
        out = jagged_attention(q, k, v, offsets, offsets, True, uih, uih, impl)
        out.backward(grad)

    return run


def gemm(n: int) -> Fn:
    a = torch.randn(n, n, device=DEVICE, dtype=_dtype())
    b = torch.randn(n, n, device=DEVICE, dtype=_dtype())
    return lambda: torch.mm(a, b)


def membound(nbytes: int) -> Fn:
    x = torch.randn(nbytes // 2, device=DEVICE, dtype=_dtype())
    y = torch.empty_like(x)
    return lambda: torch.mul(x, 1.0001, out=y)


# ---- backgrounds ----------------------------------------------------------------
class Enqueued:
    """A background of ``iters`` copies enqueued on side streams up front."""

    def __init__(self, kind: str, nbytes: int, channels: int, iters: int) -> None:
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        self.src = torch.randn(nbytes // 4, device="cuda")
        self.dst = torch.empty_like(self.src)
        self.host = torch.empty(self.src.shape, pin_memory=True)
        self.kind, self.channels, self.iters = kind, channels, iters
        self.end = torch.cuda.Event()

    def start(self) -> None:
        d2h, h2d = self.streams
        for _ in range(self.iters):
            if self.kind == "host":
                with torch.cuda.stream(d2h):
                    self.host.copy_(self.src, non_blocking=True)
                    done = torch.cuda.Event()
                    done.record()
                with torch.cuda.stream(h2d):
                    h2d.wait_event(done)
                    self.dst.copy_(self.host, non_blocking=True)
            else:
                with torch.cuda.stream(d2h):
                    channel_copy(self.src, self.dst, self.channels)
        self.end.record(h2d if self.kind == "host" else d2h)

    def stop(self) -> bool:
        """Wait for the background; True if it was still running (it outlasted the foreground)."""
        running = not self.end.query()
        self.end.synchronize()
        return running


class Looped:
    """A background AllToAll looped by a thread until stopped (real collectives)."""

    def __init__(self, kind: str, nbytes: int) -> None:
        from freescale.comm import make_communicator

        self.kind = kind
        self.comm = make_communicator("torch" if kind == "nccl" else "smfree", DEVICE)
        w = self.comm.world_size
        self.x = torch.randn(nbytes // 4 // w * w, device=DEVICE)
        self.counts = [self.x.numel() // w] * w
        self.stream = torch.cuda.Stream() if DEVICE == "cuda" else None
        self.stop_flag = threading.Event()
        self.rounds = 0

    def _loop(self) -> None:
        if self.stream is None:  # CPU ranks: the collective runs on this thread
            while self._another_round():
                self.comm.all_to_all_v(self.x, self.counts, self.counts).wait()
                self.rounds += 1
            return
        with torch.cuda.stream(self.stream):
            while self._another_round():
                self.comm.all_to_all_v(self.x, self.counts, self.counts).wait()
                self.rounds += 1
            torch.cuda.current_stream().synchronize()

    def _another_round(self) -> bool:
        """All ranks agree (a host all-reduce): a rank that stopped alone would
        leave its peers waiting in the next AllToAll forever."""
        flag = torch.tensor([int(self.stop_flag.is_set())])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return not flag.item()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def stop(self) -> bool:
        self.stop_flag.set()
        self.thread.join()
        return self.rounds > 0


def channel_copy(src: torch.Tensor, dst: torch.Tensor, programs: int) -> None:
    """Copy ``src`` to ``dst`` with a grid of ``programs`` (Triton, compiled on first use)."""
    global _COPY
    if _COPY is None:
        _COPY = _make_copy_kernel()
    _COPY[(programs,)](src, dst, src.numel(), BLOCK=4096)


_COPY = None


def _make_copy_kernel():  # Triton only when the smcopy background is used
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        # A persistent grid: each program strides over the buffer, like a channel.
        pid, nprog = tl.program_id(0), tl.num_programs(0)
        for start in range(pid * BLOCK, n, nprog * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)

    return copy


def time_fg(fg: Fn, make_bg: Callable[[], Enqueued | Looped] | None, reps: int) -> dict:
    if make_bg is None:
        return {"ms": time_ms(fg, reps), "overlapped": True}
    bg = make_bg()
    bg.start()
    ms = time_ms(fg, reps)
    return {"ms": ms, "overlapped": bg.stop()}


def round_ms(kind: str, nbytes: int, channels: int) -> float:
    """Time of one background round alone (to enqueue just enough rounds)."""
    warm = Enqueued(kind, nbytes, channels, 1)
    warm.start()  # the first round compiles the copy kernel: keep it out of the timing
    warm.stop()
    bg = Enqueued(kind, nbytes, channels, 4)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    bg.start()
    bg.end.synchronize()
    torch.cuda.current_stream().wait_event(bg.end)
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 4


DEFAULTS = {"backgrounds": ["host", "smcopy"], "uih": [1000, 4000, 21000],
            "dims": [128, 512, 1024], "tokens": 64_000, "gemm": 8192,
            "membound_bytes": 1 << 30, "bytes": 256 << 20, "channels": 32, "reps": 20}  # fmt: skip


def measure(s: Scenario, ctx: Ctx) -> Result | None:
    """Every foreground alone, beside each background, alone again; rank 0's rows."""
    args = SimpleNamespace(**{**DEFAULTS, **s.params})
    global DEVICE
    DEVICE = "cpu" if ctx.smoke or s.device == "cpu" else "cuda"
    world = 1
    if "RANK" in os.environ:
        if DEVICE == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("cpu:gloo,cuda:nccl" if DEVICE == "cuda" else "gloo")
        world = dist.get_world_size()
    fgs: dict[str, Fn] = {}
    for uih in args.uih:
        for dim in args.dims:
            fgs[f"attention fwd+bwd L={uih} d={dim}"] = attention(uih, dim, args.tokens)
    fgs[f"gemm bf16 {args.gemm}^3"] = gemm(args.gemm)
    fgs[f"membound {args.membound_bytes >> 20} MiB"] = membound(args.membound_bytes)

    kinds = list(args.backgrounds)
    if DEVICE == "cpu" and {"host", "smcopy"} & set(kinds):
        raise ValueError("backgrounds host and smcopy need CUDA; on the CPU: nccl, smfree")
    per_round = {k: round_ms(k, args.bytes, args.channels) for k in ("host", "smcopy")
                 if k in kinds}  # fmt: skip
    print(f"background round alone: {per_round} ms per {args.bytes >> 20} MiB", flush=True)

    def background(kind: str, fg_ms: float) -> Callable[[], Enqueued | Looped]:
        if kind in ("host", "smcopy"):
            # Enough rounds to outlast the foreground's warm-ups and repeats twice over.
            iters = int(2 * (args.reps + 3) * fg_ms / per_round[kind]) + 4
            return lambda: Enqueued(kind, args.bytes, args.channels, iters)
        if world < 2:
            raise ValueError(f"background {kind!r} needs 2+ ranks (launcher = torchrun)")
        return lambda: Looped(kind, args.bytes)

    rows = []
    for name, fg in fgs.items():
        first = time_fg(fg, None, args.reps)
        row: dict = {"kernel": name}
        for kind in kinds:
            row[kind] = time_fg(fg, background(kind, first["ms"]), args.reps)
        # Alone before and after the backgrounds: clocks and caches settle over a run.
        again = time_fg(fg, None, args.reps)
        row["alone_ms"] = (first["ms"] + again["ms"]) / 2
        for kind in kinds:
            row[f"{kind}_ms"] = row[kind]["ms"]
            row[f"{kind}_slowdown_pct"] = 100 * (row[kind]["ms"] / row["alone_ms"] - 1)
        rows.append(row)
        cells = "  ".join(f"{k} {row[f'{k}_slowdown_pct']:+.1f}%" for k in kinds)
        print(f"{name:40s} alone {row['alone_ms']:8.3f} ms  {cells}", flush=True)
    leader = world == 1 or dist.get_rank() == 0
    if world > 1:
        dist.destroy_process_group()
    if not leader:
        return None
    early = [f"{r['kernel']} beside {k}" for r in rows for k in kinds if not r[k]["overlapped"]]
    notes = [f"World size {world}; background volume {args.bytes >> 20} MiB per round; SM copy: "
             f"{args.channels} programs. Slowdown = with background / alone - 1."]  # fmt: skip
    notes += [f"Background ended before the foreground: {', '.join(early)}."] if early else []
    return Result(rows, notes)
