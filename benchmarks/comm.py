"""Communicator microbenchmark: latency and bandwidth of AllGather and AllToAll per backend.

For each backend and message size S (bytes per rank, 1 KiB to 256 MiB) it times
``comm.all_gather(x).wait()`` and an even ``comm.all_to_all_v(x, ...).wait()``
(S/W bytes to each rank), back to back, after warm-up. The time of one
collective is the mean over the iterations, the max over ranks (every rank
runs the same number of iterations). Bandwidth is what one rank receives
from its peers per second:

    all_gather:  (W - 1) * S / t        all_to_all:  (W - 1) / W * S / t

On the CPU the ranks are processes on one machine (gloo), so these numbers
measure the host transports themselves (shm: two memcpys through shared
memory; gloo: TCP loopback), not a GPU path.

    python -m benchmarks run comm-bandwidth            # torchrun, 2 GPUs: NCCL vs SM-free
    python -m benchmarks run comm-bandwidth --smoke    # 2 CPU ranks (gloo, shm)
    python -m benchmarks run comm-bandwidth-cpu        # 2 and 4 CPU ranks: gloo, shm, nixl

Parameters: ``backends``, ``ranks_per_host`` (emulate hosts; adds smfree-hier),
``min_bytes``, ``max_bytes`` (one number, or one per world size of ``ranks``),
``target_s`` (time per point). On the CPU every world size of ``ranks`` runs in
one report. Rows of ``smfree-nixl`` at 1 MiB and more carry ``nixl_ge_gloo``:
its bandwidth is at least that of every gloo path (``torch``, ``smfree-gloo``)
measured at the same world size, op and size. The report's per-op tables are
what ``freescale calibrate --bandwidth`` reads.
"""

from __future__ import annotations

import os
import time
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from freescale.comm import make_communicator
from freescale.testing import run_ranks

from .runner import Ctx, Result
from .scenario import Scenario

SIZES = [1 << 10 << (2 * i) for i in range(10)]  # 1 KiB, 4 KiB, ..., 256 MiB
GLOO = ("torch", "smfree-gloo")  # on the CPU both move bytes with gloo over TCP


def _time_op(fn: Any, device: torch.device, iters: int) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    mine = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the default group is gloo on the CPU
    return float(mine)


def _gather(comm: Any, x: torch.Tensor) -> None:
    comm.all_gather(x).wait()


def _a2a(comm: Any, x: torch.Tensor, send: list[int], recv: list[int]) -> None:
    comm.all_to_all_v(x, send, recv).wait()


def bench_rank(
    backends: list[str], sizes: list[int], device: str, rph: int | None, target_s: float
) -> list:
    dev = torch.device(device)
    if dev.type == "cuda":
        # Several ranks may share one GPU (rank % device count).
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    w, rows = dist.get_world_size(), []
    for backend in backends:
        kw = {"ranks_per_host": rph} if backend == "smfree-hier" and rph else {}
        comm = make_communicator(backend, dev, **kw)
        for size in sizes:
            x = torch.ones(size // 4, dtype=torch.float32, device=dev)
            split = [x.numel() // w] * w
            split[-1] += x.numel() - sum(split)
            recv = [split[comm.rank]] * w  # every rank uses the same split
            ops = {
                "all_gather": (partial(_gather, comm, x), (w - 1) * size),
                "all_to_all": (partial(_a2a, comm, x, split, recv), (w - 1) * recv[0] * 4),
            }
            for op, (fn, moved) in ops.items():
                fn()  # warm-up (buffers, connections)
                once = _time_op(fn, dev, 1)
                iters = max(3, min(200, int(target_s / max(once, 1e-6))))
                t = _time_op(fn, dev, iters)
                rows.append(
                    {"backend": backend, "op": op, "bytes": size, "iters": iters, "world": w,
                     "latency_us": t * 1e6, "GBps": moved / t / 1e9}
                )  # fmt: skip
        if hasattr(comm, "close"):
            comm.close()
    return rows


def _fmt_bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def tables(rows: list[dict]) -> list[str]:
    """Per op (and world size, if several): latency us / GB/s per backend and size
    (``freescale calibrate`` reads these)."""
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    worlds = sorted({r.get("world") for r in rows}, key=lambda w: w or 0)
    lines = []
    for world in worlds:
        mine = [r for r in rows if r.get("world") == world]
        at = f", {world} ranks" if len(worlds) > 1 else ""
        for op in ("all_gather", "all_to_all"):
            lines += [f"## {op}: latency us / bandwidth GB/s (received from peers, per rank){at}"]
            lines += ["", "| bytes per rank | " + " | ".join(backends) + " |"]
            lines += ["|---|" + "---|" * len(backends)]
            for size in sorted({r["bytes"] for r in mine}):
                cells = []
                for b in backends:
                    key = (b, op, size)
                    (r,) = [r for r in mine if (r["backend"], r["op"], r["bytes"]) == key]
                    cells.append(f"{r['latency_us']:.0f} / {r['GBps']:.2f}")
                lines.append(f"| {_fmt_bytes(size)} | " + " | ".join(cells) + " |")
            lines.append("")
    return lines


def mark_nixl_vs_gloo(rows: list[dict]) -> None:
    """Set ``nixl_ge_gloo`` on each smfree-nixl row of 1 MiB or more (see module doc)."""
    for r in rows:
        if r["backend"] != "smfree-nixl" or r["bytes"] < 1 << 20:
            continue
        key = (r.get("world"), r["op"], r["bytes"])
        gloo = [g["GBps"] for g in rows if g["backend"] in GLOO
                and (g.get("world"), g["op"], g["bytes"]) == key]  # fmt: skip
        if gloo:
            r["nixl_ge_gloo"] = r["GBps"] >= max(gloo)


DEFAULTS = {"backends": ["torch", "smfree-shm", "smfree-gloo"], "ranks_per_host": None,
            "min_bytes": 4 << 10, "max_bytes": 64 << 20, "target_s": 0.25}  # fmt: skip


def measure(s: Scenario, ctx: Ctx) -> Result | None:
    """Under torchrun (GPUs): this process is a rank; else ``ranks[0]`` gloo ranks here."""
    args = SimpleNamespace(**{**DEFAULTS, **s.params})
    backends = list(args.backends)
    if args.ranks_per_host and "smfree-hier" not in backends:
        backends.append("smfree-hier")
    caps = args.max_bytes if isinstance(args.max_bytes, list) else [args.max_bytes] * len(s.ranks)
    device = "cpu" if ctx.smoke or s.device == "cpu" else "cuda"

    def call(cap: int) -> tuple:
        sizes = [x for x in SIZES if args.min_bytes <= x <= cap]
        return (backends, sizes, device, args.ranks_per_host, args.target_s)

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("cpu:gloo,cuda:nccl" if device == "cuda" else "gloo")
        rows, worlds = bench_rank(*call(caps[0])), [dist.get_world_size()]
        leader = dist.get_rank() == 0
        dist.destroy_process_group()
        if not leader:
            return None
    else:
        rows, worlds = [], list(s.ranks)
        for world, cap in zip(worlds, caps, strict=True):
            rows += run_ranks(bench_rank, world, *call(cap), timeout=3600)[0]
    mark_nixl_vs_gloo(rows)
    note = (f"World size {', '.join(map(str, worlds))}" + (f", {args.ranks_per_host} ranks per"
            f" emulated host" if args.ranks_per_host else "") + f"; device {device}; load"
            f" average at the end {os.getloadavg()[0]:.1f}.")  # fmt: skip
    return Result(rows, [note, "", *tables(rows)])
