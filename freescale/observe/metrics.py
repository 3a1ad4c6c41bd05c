"""Step metrics (defined below), gathered from all ranks once per step.

Every per-rank time is an interval of one clock: CUDA events on the compute
stream (GPU ranks) or the host's wall clock (CPU ranks), never a mix.

- straggler % = mean over ranks of (max_r C_r − C_r) / T_iter, C_r = rank r's
  compute time of the step: its step interval minus the compute stream's
  waits on communication (exposed) and on input (data wait), T_iter = the
  step time (max over ranks).
- data wait: how long the compute stream starved for the batch (the loader
  or its copy was late); a host waiting while the GPU still has queued work
  costs nothing and counts nothing.
- exposed communication: per category, mean over ranks, ms per step.
- QPS = items (UIH tokens + candidates) of all ranks per second of T_iter.
- NE = mean BCE / entropy of the label base rate.
- TFLOP/s per GPU = F_r / T_iter, F_r = the model's FLOPs of rank r's batch
  (``flops(batch)``: forward + backward); ``tflops`` is their mean over ranks,
  ``step_tflop`` their sum (the step's FLOPs), and MFU % = 100 · tflops / the
  device's dense bf16 peak. Null where the model counts no FLOPs, or (MFU)
  where no peak is known (CPUs, devices not in `freescale.observe.flops`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from freescale.balance.world import FEATURES
from freescale.models.loss import normalized_entropy
from freescale.observe.timing import CATEGORIES

# Order of the per-rank vector that is all-gathered.
# a rank's dynamic tables in a step (`ShardedEmbeddingCollection.dynamic_counts`)
DYNAMIC_COUNTS = ("held", "slots", "inserts", "evictions", "not_admitted", "dropped")
_FIELDS = (
    "step_ms",
    "compute_ms",
    "data_ms",
    *CATEGORIES,
    "collision_part_ms",
    "collision_rows",
    "rows_next",
    "collision_ids",
    "ids_next",
    "bce_sum",
    "positives",
    "candidates",
    "items",
    "samples",
    "stop",  # 1: this rank was asked to stop (SIGTERM); all ranks see it in the same step
    "nonfinite",  # 1: this rank's loss or embedding gradients were not finite
    "loss_sum",  # the model's own loss, summed over this rank's candidates
    "flops",  # the model's FLOPs of this rank's batch (NaN: not counted)
    "compiled_frames",  # frames dynamo compiled during this rank's step
    "attention_graphs",  # cuDNN attention graphs built during this rank's step
    "host_tier",  # 1: this rank has host-tier tables (then the two below are reported)
    "host_tier_ms",  # the compute stream's time in host-tier reads and updates
    "host_tier_bytes",  # bytes the host tier moved between host and device
    "dynamic",  # 1: this rank has dynamic tables (then the six below are reported)
    *(f"dynamic_{k}" for k in DYNAMIC_COUNTS),
    *(f"feature_{name}" for name in FEATURES),
)
STOP = _FIELDS.index("stop")
NONFINITE = _FIELDS.index("nonfinite")


@dataclass
class RankStep:
    step_ms: float
    compute_ms: float
    data_ms: float
    exposed: dict[str, float]
    bce_sum: float
    positives: float
    candidates: float
    items: float
    samples: float
    collision_part_ms: float = 0.0
    # freescale mode: rows of C^i, rows step i+1 reads, and the same in ids (this rank's shards)
    collision: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    stop: float = 0.0
    nonfinite: float = 0.0
    features: tuple[float, ...] = (0.0,) * len(FEATURES)  # this rank's batch, summed
    loss_sum: float | None = None  # the model's loss when it is not BCE (None: bce_sum)
    flops: float | None = None  # the model's FLOPs of this rank's batch (None: not counted)
    compiled_frames: float = 0.0  # frames dynamo compiled during the step (dense.compile)
    attention_graphs: float = 0.0  # cuDNN attention graphs built during the step
    host_tier: tuple[float, float] | None = None  # (exposed ms, bytes); None: no host tier
    dynamic: tuple[float, ...] | None = None  # DYNAMIC_COUNTS; None: no dynamic table

    def vector(self, device: torch.device) -> torch.Tensor:
        values = [
            self.step_ms,
            self.compute_ms,
            self.data_ms,
            *(self.exposed.get(c, 0.0) for c in CATEGORIES),
            self.collision_part_ms,
            *self.collision,
            self.bce_sum,
            self.positives,
            self.candidates,
            self.items,
            self.samples,
            self.stop,
            self.nonfinite,
            self.bce_sum if self.loss_sum is None else self.loss_sum,
            math.nan if self.flops is None else self.flops,
            self.compiled_frames,
            self.attention_graphs,
            float(self.host_tier is not None),
            *(self.host_tier or (0.0, 0.0)),
            float(self.dynamic is not None),
            *(self.dynamic or (0.0,) * len(DYNAMIC_COUNTS)),
            *self.features,
        ]
        return torch.tensor(values, dtype=torch.float64, device=device)


def gather_step(local: RankStep, group: Any = None) -> torch.Tensor:
    """``[world, fields]`` of every rank's numbers: one small all_gather over
    ``group``, a gloo group, so that metrics never wait for the GPU."""
    vec = local.vector(torch.device("cpu"))
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return vec.unsqueeze(0)
    out = [torch.empty_like(vec) for _ in range(dist.get_world_size())]
    dist.all_gather(out, vec, group=group)
    return torch.stack(out)


def summarize_step(step: int, table: torch.Tensor, peak: float | None = None) -> dict[str, Any]:
    """The step's JSON line from every rank's numbers (``peak``: TFLOP/s per device)."""
    # One read of the table, then Python: on a few CPU numbers each torch op
    # costs the launch thread more than its arithmetic. The sums behind the
    # loss and NE stay torch's, so their rounding is unchanged at any W.
    rows = table.tolist()
    col = {name: [r[i] for r in rows] for i, name in enumerate(_FIELDS)}
    bce, pos, cands, loss = (
        float(table[:, _FIELDS.index(k)].sum())
        for k in ("bce_sum", "positives", "candidates", "loss_sum")
    )
    t_iter = max(col["step_ms"])
    compute = col["compute_ms"]
    slowest = max(compute)
    straggler = _mean([(slowest - c) / t_iter for c in compute]) * 100 if t_iter > 0 else 0.0
    return {
        "step": step,
        "step_ms": t_iter,
        "compute_ms": _rounded(compute),
        "straggler_pct": straggler,
        "exposed_comm_ms": {c: _mean(col[c]) for c in CATEGORIES},
        # of emb_a2a + grad_a2a, the part spent waiting for collision rows (freescale)
        "exposed_collision_ms": _mean(col["collision_part_ms"]),
        # share of step i+1's rows / ids that step i updates first (freescale), all shards
        "collision_rows_pct": _pct(sum(col["collision_rows"]), sum(col["rows_next"])),
        "collision_ids_pct": _pct(sum(col["collision_ids"]), sum(col["ids_next"])),
        "collision_rows_pct_ranks": [
            _pct(a, b) for a, b in zip(col["collision_rows"], col["rows_next"], strict=True)
        ],
        "data_wait_ms": _mean(col["data_ms"]),
        # per rank: the summed cost features of its batch (FEATURES order), so a
        # compute model can be fitted from and checked against the JSON lines
        "rank_features": [[r[i] for i in _FEATURE_COLUMNS] for r in rows],
        # per rank, in rank order
        "step_ms_ranks": _rounded(col["step_ms"]),
        "data_wait_ms_ranks": _rounded(col["data_ms"]),
        "exposed_comm_ms_ranks": {c: _rounded(col[c]) for c in CATEGORIES},
        "qps": sum(col["items"]) / (t_iter / 1000.0) if t_iter > 0 else 0.0,
        "loss": loss / cands if cands else float("nan"),
        "ne": normalized_entropy(bce, pos, cands),
        "samples": int(sum(col["samples"])),
        "items": int(sum(col["items"])),
        # frames dynamo compiled during the step, the most of any rank: after
        # warm-up 0 under dense.compile (a recompile shows here)
        "compiled_frames": int(max(col["compiled_frames"])),
        # cuDNN graphs built (each a pause of the step: a new length or token cap)
        "attention_graphs_built": int(max(col["attention_graphs"])),
        **_throughput(col["flops"], t_iter, peak),
        **_host_tier(col, t_iter),
        **_dynamic(col),
    }


def _dynamic(col: dict[str, list[float]]) -> dict[str, Any]:
    """Dynamic tables over all ranks, only in runs that have them: the share of
    their slots held, and the step's inserts, evictions, ids seen without a
    row (not yet admitted) and gradient rows dropped for them."""
    if not any(col["dynamic"]):
        return {}
    total = {k: sum(col[f"dynamic_{k}"]) for k in DYNAMIC_COUNTS}
    return {
        "dynamic_occupancy_pct": _pct(total["held"], total["slots"]),
        **{f"dynamic_{k}": int(total[k]) for k in DYNAMIC_COUNTS[2:]},
    }


def _host_tier(col: dict[str, list[float]], t_iter: float) -> dict[str, Any]:
    """The host tier's traffic, only in runs that place tables on the host:
    bytes of all ranks, the compute stream's exposed part (mean over ranks),
    and the bytes per second of step time of one rank (mean)."""
    if not any(col["host_tier"]):
        return {}
    moved = col["host_tier_bytes"]
    return {
        "host_tier_bytes": int(sum(moved)),
        "host_tier_exposed_ms": _mean(col["host_tier_ms"]),
        "host_tier_gb_s": _mean(moved) / (t_iter * 1e6) if t_iter > 0 else 0.0,
    }


def _throughput(flops: list[float], t_iter: float, peak: float | None) -> dict[str, Any]:
    """The FLOPs fields: null unless every rank's batch was counted (and, for
    the rates, the step took time; for MFU, the peak is known)."""
    if not all(math.isfinite(f) for f in flops):
        return {"step_tflop": None, "tflops": None, "tflops_ranks": None, "mfu_pct": None}
    rates = [f / (t_iter / 1000.0) / 1e12 for f in flops] if t_iter > 0 else None
    tflops = None if rates is None else _mean(rates)
    return {
        "step_tflop": sum(flops) / 1e12,
        "tflops": tflops,
        "tflops_ranks": None if rates is None else [float(f"{r:.4g}") for r in rates],
        "mfu_pct": 100.0 * tflops / peak if tflops is not None and peak else None,
    }


_FEATURE_COLUMNS = [_FIELDS.index(f"feature_{n}") for n in FEATURES]


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _pct(part: float, whole: float) -> float:
    return round(100.0 * part / whole, 3) if whole > 0 else 0.0


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 3) for v in values]


@dataclass
class RunSummary:
    """Means over the measured (post-warm-up) steps, plus the final NE."""

    warmup: int
    steps: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    peak_tflops: float | None = None  # what MFU divides by (None: unknown)

    def add(self, record: dict[str, Any]) -> None:
        self.steps.append(record)

    def final(self, extra: dict[str, Any]) -> dict[str, Any]:
        measured = [s for s in self.steps if s["step"] >= self.warmup] or self.steps

        def mean(key: str) -> float:
            return sum(s[key] for s in measured) / len(measured)

        def known_mean(key: str) -> float | None:  # None where any step has none
            values = [s.get(key) for s in measured]
            if not values or None in values:
                return None
            return sum(values) / len(values)  # type: ignore[arg-type]

        return {
            "steps": len(self.steps),
            "measured_steps": len(measured),
            "samples": sum(s["samples"] for s in self.steps),
            "ne": self.evals[-1]["ne"] if self.evals else None,
            "ne_first_eval": self.evals[0]["ne"] if self.evals else None,
            "train_ne_last": self.steps[-1]["ne"] if self.steps else None,
            "step_ms": mean("step_ms"),
            "compute_ms_mean": sum(sum(s["compute_ms"]) / len(s["compute_ms"]) for s in measured)
            / len(measured),
            "data_wait_ms": mean("data_wait_ms"),
            "data_wait_ms_max": sum(max(s["data_wait_ms_ranks"]) for s in measured) / len(measured),
            "qps": mean("qps"),
            "straggler_pct": mean("straggler_pct"),
            "exposed_comm_ms": {
                c: sum(s["exposed_comm_ms"][c] for s in measured) / len(measured)
                for c in CATEGORIES
            },
            "exposed_collision_ms": mean("exposed_collision_ms"),
            "collision_rows_pct": mean("collision_rows_pct"),
            "collision_ids_pct": mean("collision_ids_pct"),
            "step_tflop": known_mean("step_tflop"),
            "tflops": known_mean("tflops"),
            "mfu_pct": known_mean("mfu_pct"),
            "peak_tflops": self.peak_tflops,
            "compiled_frames_after_warmup": sum(s.get("compiled_frames", 0) for s in measured),
            "attention_graphs_after_warmup": sum(
                s.get("attention_graphs_built", 0) for s in measured
            ),
            **_host_tier_means(measured),
            **extra,
        }


def _host_tier_means(measured: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("host_tier_bytes", "host_tier_exposed_ms", "host_tier_gb_s")
    if not measured or keys[0] not in measured[0]:
        return {}
    return {k: sum(s[k] for s in measured) / len(measured) for k in keys}


class JsonLines:
    """JSON-lines writer of the per-step metrics (rank 0 only); no-op without a path.

    `start` opens it: a run from step 0 writes a new file; a run resumed at
    step ``n`` keeps the lines of the steps before ``n`` (the run it continues)
    and appends. Lines of steps ``n`` and later were written by an attempt
    that died before its next checkpoint: this run writes those steps again,
    so they are dropped, and the file reads as one uninterrupted run.
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path) if path else None
        self.file = None

    def start(self, first_step: int) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if first_step > 0 and self.path.exists():
            _keep_steps_before(self.path, first_step)
        self.file = open(self.path, "a" if first_step > 0 else "w")  # noqa: SIM115 - kept open

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _keep_steps_before(path: Path, first_step: int) -> None:
    """Rewrite ``path`` (atomically) with its lines of steps before ``first_step``;
    a torn last line (its writer killed mid-line) goes too."""
    kept = []
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError):
            continue
        if isinstance(step, int) and step < first_step:
            kept.append(line + "\n")
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(kept))
    os.replace(partial, path)
