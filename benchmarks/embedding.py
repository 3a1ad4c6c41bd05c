"""Sharded embedding benchmark: lookup + update throughput and the time split of a step.

One synchronous training step ("vanilla TorchRec") of a row-wise sharded table:
preflight (validation + counts exchange), ids AllToAll, local lookup,
embeddings AllToAll, gradient AllToAll, update (duplicate sum + sparse
optimizer). Each phase is timed between device synchronizations (the max
over ranks is reported); the step time is measured separately without
the per-phase synchronizations. Lookup and update bandwidth are compared
with a measured HBM copy bandwidth (``dst.copy_(src)``, read + write).

Bytes counted (per rank, M ids received for lookup, U unique rows updated,
D dim, e bytes per element, s optimizer-state bytes per row):
  lookup: M * (2 * D * e + 8)            read rows, write output, read slots
  update: M * D * e + U * (2 * D * e + 2 * s)   read grads, r/w rows and state

    torchrun --nproc-per-node 2 benchmarks/embedding.py --out benchmarks/results/embedding_2xH200.md
    python benchmarks/embedding.py --device cpu --quick      # seconds, on gloo
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import socket
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from freescale.comm import TorchCommunicator
from freescale.embedding import (
    SGD,
    Adam,
    RowSharding,
    RowwiseAdagrad,
    ShardedEmbeddingCollection,
    ShardingPlan,
    TableConfig,
)
from freescale.jagged import JaggedTensor

PHASES = ("preflight", "ids_a2a", "lookup", "emb_a2a", "grad_a2a", "update")
OPTIMIZERS = {"sgd": (SGD, 0), "adagrad": (RowwiseAdagrad, 4), "adam": (Adam, None)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--rows", default="1e6,1e7,1e8", help="comma-separated table sizes")
    p.add_argument("--samples", type=int, default=128, help="samples per rank")
    p.add_argument("--ids-per-sample", type=int, default=4000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), default="adagrad")
    p.add_argument("--assignment", choices=("hashed", "block"), default="hashed")
    p.add_argument("--alpha", type=float, default=1.05, help="Zipf exponent of ids; 0 = uniform")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="tiny shapes, runs in seconds on CPU")
    p.add_argument("--out", default=None, help="markdown report path")
    args = p.parse_args(argv)
    if args.quick:
        args.rows, args.samples, args.ids_per_sample, args.dim = "1e4,1e5", 4, 50, 16
        args.warmup, args.steps = 1, 2
    args.row_list = [int(float(r)) for r in args.rows.split(",")]
    return args


# ---- setup ---------------------------------------------------------------------
def init_distributed(device: str) -> torch.device:
    """torchrun's env if present, else a one-rank group on a free local port."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        return torch.device("cuda", local)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def barrier(comm) -> None:
    """All ranks here, device idle: a tiny all_gather through the Communicator."""
    comm.all_gather(torch.zeros(1, device=comm.device)).wait()
    sync(comm.device)


class PhaseTimer:
    """The collection's ``timer`` hook: wall time of each phase between syncs,
    while ``enabled`` (the untimed steps run without the syncs)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.times: dict[str, list[float]] = defaultdict(list)
        self.enabled = True

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        sync(self.device)
        start = time.perf_counter()
        yield
        sync(self.device)
        self.times[name].append(time.perf_counter() - start)


def hbm_copy_gbps(device: torch.device, nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device copy bandwidth, counting read + write."""
    if device.type == "cpu":
        nbytes, reps = 1 << 26, 3
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - start) / 1e9


def zipf_ids(n: int, rows: int, alpha: float, gen: torch.Generator, device) -> torch.Tensor:
    """Power-law ids in [0, rows) by inverse CDF of a continuous x^-alpha on [1, rows+1)."""
    u = torch.rand(n, generator=gen, device=device, dtype=torch.float64)
    if alpha == 0:
        x = u * rows
    elif abs(alpha - 1.0) < 1e-9:
        x = torch.exp(u * math.log(rows + 1.0)) - 1
    else:
        a = 1.0 - alpha
        x = ((((rows + 1.0) ** a - 1.0) * u + 1.0) ** (1.0 / a)) - 1
    return x.long().clamp_(0, rows - 1)


# ---- one configuration -------------------------------------------------------------
def state_bytes_per_row(opt: str, dim: int) -> int:
    per = OPTIMIZERS[opt][1]
    return 8 * dim if per is None else per


def fits(args, rows: int, world: int, device: torch.device) -> bool:
    if device.type != "cuda":
        return True
    e = DTYPES[args.dtype].itemsize
    need = rows / world * (args.dim * e + state_bytes_per_row(args.optimizer, args.dim))
    need += args.samples * args.ids_per_sample * args.dim * 4 * 12  # activations, buffers
    return need < 0.85 * torch.cuda.mem_get_info(device)[0]


def make_batches(args, rows: int, comm, device) -> list[JaggedTensor]:
    gen = torch.Generator(device=device).manual_seed(17 + comm.rank)
    n = args.samples * args.ids_per_sample
    lengths = torch.full((args.samples,), args.ids_per_sample, device=device)
    return [
        JaggedTensor.from_lengths(zipf_ids(n, rows, args.alpha, gen, device), lengths)
        for _ in range(args.warmup + args.steps)
    ]


def received_and_unique(batch: JaggedTensor, rows: int, comm, assignment: str) -> tuple[int, int]:
    """Ids this rank serves (M) and the unique rows it updates (U) in one step."""
    every = comm.all_gather(batch.values).wait()
    owner, slot = RowSharding(rows, comm.world_size, assignment).locate(every)
    mine = slot[owner == comm.rank]
    return mine.numel(), torch.unique(mine).numel()


def run_config(args, rows: int, comm, device: torch.device) -> dict:
    opt_cls = OPTIMIZERS[args.optimizer][0]
    table = TableConfig("t", rows, args.dim, DTYPES[args.dtype], feature_names=("ids",))
    timer = PhaseTimer(device)
    plan = ShardingPlan(optimizer=opt_cls(), assignment=args.assignment)
    coll = ShardedEmbeddingCollection([table], comm, plan, device, timer=timer)
    batches = make_batches(args, rows, comm, device)
    grad = torch.randn(batches[0].values.numel(), args.dim, device=device).to(table.dtype)

    def step(batch: JaggedTensor) -> None:
        coll({"ids": batch})["ids"].values.backward(grad)

    for i, batch in enumerate(batches):
        if i == args.warmup:
            timer.times.clear()
        step(batch)
    timer.enabled = False
    barrier(comm)
    start = time.perf_counter()
    for batch in batches[args.warmup :]:
        step(batch)
    sync(device)
    step_s = (time.perf_counter() - start) / args.steps
    m, u = received_and_unique(batches[-1], rows, comm, args.assignment)
    phases = {p: sum(timer.times[p]) / max(len(timer.times[p]), 1) for p in PHASES}
    return {
        "rows": rows,
        "ids": batches[0].values.numel(),
        "m": m,
        "u": u,
        "step_s": step_s,
        **phases,
    }


def reduce_over_ranks(result: dict, comm) -> dict:
    """Times: max over ranks; M and U: max over ranks (the busiest shard)."""
    keys = ["step_s", "m", "u", *PHASES]
    local = torch.tensor([float(result[k]) for k in keys], dtype=torch.float64, device=comm.device)
    gathered = comm.all_gather(local.unsqueeze(0)).wait().max(dim=0).values.tolist()
    return {**result, **dict(zip(keys, gathered, strict=True))}


def derive(r: dict, args, world: int, hbm: float) -> dict:
    e = DTYPES[args.dtype].itemsize
    s = state_bytes_per_row(args.optimizer, args.dim)
    lookup_bytes = r["m"] * (2 * args.dim * e + 8)
    update_bytes = r["m"] * args.dim * e + r["u"] * (2 * args.dim * e + 2 * s)
    lookup_gbps = lookup_bytes / max(r["lookup"], 1e-12) / 1e9
    update_gbps = update_bytes / max(r["update"], 1e-12) / 1e9
    return {
        **r,
        "world_size": world,
        "lookup_mb": lookup_bytes / 1e6,
        "lookup_gbps": lookup_gbps,
        "lookup_hbm_frac": lookup_gbps / hbm,
        "update_gbps": update_gbps,
        "update_hbm_frac": update_gbps / hbm,
        "lookup_rows_per_s": r["m"] / max(r["lookup"], 1e-12),
        "update_rows_per_s": r["u"] / max(r["update"], 1e-12),
        "step_ids_per_s": r["ids"] * world / r["step_s"],
    }


# ---- report ----------------------------------------------------------------------
COLUMNS = [
    ("rows", "{:.0e}"),
    ("m", "{:.0f}"),
    ("u", "{:.0f}"),
    ("step_s", "ms"),
    *[(p, "ms") for p in PHASES],
    ("lookup_gbps", "{:.3g}"),
    ("lookup_hbm_frac", "{:.1%}"),
    ("update_gbps", "{:.3g}"),
    ("update_hbm_frac", "{:.1%}"),
    ("step_ids_per_s", "{:.3g}"),
]
HEADERS = [
    "rows",
    "ids served/rank",
    "unique rows/rank",
    "step ms",
    "preflight ms",
    "ids a2a ms",
    "lookup ms",
    "emb a2a ms",
    "grad a2a ms",
    "update ms",
    "lookup GB/s",
    "lookup %HBM",
    "update GB/s",
    "update %HBM",
    "ids/s (all ranks)",
]


def fmt(value, spec: str) -> str:
    if isinstance(value, str):
        return value
    return f"{value * 1e3:.2f}" if spec == "ms" else spec.format(value)


def table_markdown(results: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for r in results:
        if "skipped" in r:
            cells = [fmt(r["rows"], "{:.0e}"), r["skipped"]] + [""] * (len(HEADERS) - 2)
        else:
            cells = [fmt(r[k], spec) for k, spec in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine(device: torch.device, world: int) -> str:
    parts = [platform.node(), f"torch {torch.__version__}", f"{world} rank(s)"]
    if device.type == "cuda":
        parts.insert(1, f"{world}x {torch.cuda.get_device_name(device)}")
        parts.append(
            f"CUDA {torch.version.cuda}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}"
        )
    else:
        parts.insert(1, f"CPU ({os.cpu_count()} cores), gloo")
    return ", ".join(parts)


def write_report(path: str, args, results: list[dict], hbm: float, device, world: int) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        launcher = f"torchrun --nproc-per-node {os.environ.get('LOCAL_WORLD_SIZE', world)}"
    else:
        launcher = "python"
    command = f"{launcher} {' '.join(sys.argv)}"
    text = [
        "# Sharded embedding benchmark (synchronous baseline)",
        "",
        f"- machine: {machine(device, world)}",
        f"- date: {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{command}`",
        f"- step: {args.samples} samples x {args.ids_per_sample} ids per rank, dim {args.dim},"
        f" {args.dtype}, {args.optimizer}, {args.assignment} assignment, Zipf alpha {args.alpha}",
        f"- HBM copy bandwidth (read + write): {hbm:.0f} GB/s",
        "",
        table_markdown(results),
        "",
        "Phase times are max over ranks, each between device syncs; the step time is"
        " measured without them. Bytes: see the docstring of benchmarks/embedding.py.",
        "",
    ]
    out.write_text("\n".join(text))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = init_distributed(args.device)
    comm = TorchCommunicator(device=device)
    world, rank = comm.world_size, comm.rank
    hbm = hbm_copy_gbps(device)
    results = []
    for rows in args.row_list:
        ok = torch.tensor([float(fits(args, rows, world, device))], device=device)
        if float(comm.all_gather(ok).wait().min()) < 1:
            results.append({"rows": rows, "skipped": "skipped: does not fit in memory"})
            continue
        r = reduce_over_ranks(run_config(args, rows, comm, device), comm)
        results.append(derive(r, args, world, hbm))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        print(f"HBM copy: {hbm:.0f} GB/s; {machine(device, world)}")
        print(table_markdown(results))
        if args.out:
            write_report(args.out, args, results, hbm, device, world)
        print(
            json.dumps(
                {
                    "benchmark": "embedding",
                    "world_size": world,
                    "device": args.device,
                    "hbm_copy_gbps": hbm,
                    "results": results,
                }
            )
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
