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

    python -m benchmarks run fig7-embedding            # torchrun, 2 GPUs
    python -m benchmarks run fig7-embedding --smoke    # seconds, 2 gloo ranks

Parameters: ``rows`` (table sizes), ``samples``, ``ids_per_sample``, ``dim``,
``dtype``, ``optimizer``, ``assignment``, ``alpha``, ``warmup``, ``steps``.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import torch
import torch.distributed as dist

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

from .runner import Ctx, Result
from .scenario import Scenario

PHASES = ("preflight", "ids_a2a", "lookup", "emb_a2a", "grad_a2a", "update")
OPTIMIZERS = {"sgd": (SGD, 0), "adagrad": (RowwiseAdagrad, 4), "adam": (Adam, None)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


DEFAULTS = {"rows": [10**6, 10**7, 10**8], "samples": 128, "ids_per_sample": 4000, "dim": 128,
            "dtype": "fp32", "optimizer": "adagrad", "assignment": "hashed", "alpha": 1.05,
            "warmup": 3, "steps": 10}  # fmt: skip
QUICK = {"rows": [10**4, 10**5], "samples": 4, "ids_per_sample": 50, "dim": 16, "warmup": 1,
         "steps": 2}  # fmt: skip


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


def measure(s: Scenario, ctx: Ctx) -> Result | None:
    """Every table size on this rank (torchrun) or a one-rank group; rank 0's rows."""
    args = SimpleNamespace(**{**DEFAULTS, **(QUICK if ctx.smoke else {}), **s.params})
    args.device = "cpu" if ctx.smoke or s.device == "cpu" else "cuda"
    device = init_distributed(args.device)
    comm = TorchCommunicator(device=device)
    world, rank = comm.world_size, comm.rank
    hbm = hbm_copy_gbps(device)
    results = []
    for rows in args.rows:
        ok = torch.tensor([float(fits(args, rows, world, device))], device=device)
        if float(comm.all_gather(ok).wait().min()) < 1:
            results.append({"rows": rows, "skipped": "skipped: does not fit in memory"})
            continue
        r = reduce_over_ranks(run_config(args, rows, comm, device), comm)
        results.append(derive(r, args, world, hbm))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    if rank != 0:
        return None
    notes = [
        f"World size {world}; step: {args.samples} samples x {args.ids_per_sample} ids per rank,"
        f" dim {args.dim}, {args.dtype}, {args.optimizer}, {args.assignment} assignment, Zipf"
        f" alpha {args.alpha}; HBM copy bandwidth (read + write): {hbm:.0f} GB/s.", "",
        table_markdown(results), "",
        "Phase times are max over ranks, each between device syncs; the step time is measured"
        " without them. Bytes: see the docstring of benchmarks/embedding.py.",
    ]  # fmt: skip
    return Result(results, notes)
