"""Communicator microbenchmark: latency and bandwidth of AllGather and AllToAll per backend.

For each backend and message size S (bytes per rank, 4 KiB to 64 MiB) it times
``comm.all_gather(x).wait()`` and an even ``comm.all_to_all_v(x, ...).wait()``
(S/W bytes to each rank), back to back, after warm-up. The time of one
collective is the mean over the iterations, the max over ranks (every rank
runs the same number of iterations). Bandwidth is what one rank receives
from its peers per second:

    all_gather:  (W - 1) * S / t        all_to_all:  (W - 1) / W * S / t

On the CPU the ranks are processes on one machine (gloo), so these numbers
measure the host transports themselves (shm: two memcpys through shared
memory; gloo: TCP loopback), not a GPU path.

    python benchmarks/comm_bandwidth.py --world-size 2 --out benchmarks/results/x.md
    python benchmarks/comm_bandwidth.py --world-size 4 --ranks-per-host 2   # + smfree-hier
    torchrun --nproc-per-node 2 benchmarks/comm_bandwidth.py --device cuda   # on a GPU host
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freescale.comm import make_communicator
from freescale.testing import run_ranks

SIZES = [4 << 10 << (2 * i) for i in range(8)]  # 4 KiB, 16 KiB, ..., 64 MiB


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-size", type=int, default=2, help="ranks (ignored under torchrun)")
    p.add_argument("--backends", default="torch,smfree-shm,smfree-gloo")
    p.add_argument("--ranks-per-host", type=int, default=None, help="emulate hosts; adds hier")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--max-bytes", type=int, default=SIZES[-1])
    p.add_argument("--target-s", type=float, default=0.25, help="time per point (approx.)")
    p.add_argument("--out", default="", help="write the markdown report here")
    return p.parse_args(argv)


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
                    {"backend": backend, "op": op, "bytes": size, "iters": iters,
                     "latency_us": t * 1e6, "GBps": moved / t / 1e9}
                )  # fmt: skip
        if hasattr(comm, "close"):
            comm.close()
    return rows


def _fmt_bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def report(rows: list[dict], world: int, args: argparse.Namespace, command: str) -> str:
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    lines = [
        "# Communicator bandwidth (benchmarks/comm_bandwidth.py)",
        "",
        f"- machine: {platform.node() or 'unknown'}, {platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, device {args.device}",
        f"- date: {dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC; load average at the end"
        f" {os.getloadavg()[0]:.1f} (other jobs share the machine: latencies are noisy)",
        f"- command: `{command}`",
        f"- world size {world}"
        + (f", {args.ranks_per_host} ranks per emulated host" if args.ranks_per_host else ""),
        "",
    ]
    for op in ("all_gather", "all_to_all"):
        lines += [f"## {op}: latency us / bandwidth GB/s (received from peers, per rank)", ""]
        lines += ["| bytes per rank | " + " | ".join(backends) + " |"]
        lines += ["|---|" + "---|" * len(backends)]
        for size in sorted({r["bytes"] for r in rows}):
            cells = []
            for b in backends:
                (r,) = [r for r in rows if (r["backend"], r["op"], r["bytes"]) == (b, op, size)]
                cells.append(f"{r['latency_us']:.0f} / {r['GBps']:.2f}")
            lines.append(f"| {_fmt_bytes(size)} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    if args.ranks_per_host and "smfree-hier" not in backends:
        backends.append("smfree-hier")
    sizes = [s for s in SIZES if s <= args.max_bytes]
    call = (backends, sizes, args.device, args.ranks_per_host, args.target_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        # CPU tensors (timing reductions, smfree's own groups) on gloo, CUDA ones on NCCL.
        dist.init_process_group("cpu:gloo,cuda:nccl" if args.device == "cuda" else "gloo")
        rows, world = bench_rank(*call), dist.get_world_size()
        leader = dist.get_rank() == 0
        dist.destroy_process_group()
        if not leader:
            return
    else:
        world = args.world_size
        rows = run_ranks(bench_rank, world, *call, timeout=3600)[0]
    command = "python " + " ".join([sys.argv[0], *sys.argv[1:]])
    text = report(rows, world, args, command)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps({"benchmark": "comm_bandwidth", "world_size": world, "rows": rows}))


if __name__ == "__main__":
    main()
