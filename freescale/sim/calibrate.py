"""Calibration of the simulator from measured runs (pure numpy; docs/simulator.md).

Inputs are what the trainer and the benchmarks already write:

- step JSON lines (``--metrics-jsonl`` of ``freescale train``, the step-log
  archives ``benchmarks/results/steps-*.tgz``): per step ``compute_ms`` per rank, the exposed
  communication per category (mean over ranks), ``step_ms``, ``items`` and, on
  builds from 10827f2 on, ``rank_features`` (``[W][5]`` summed features of
  every rank's batch as trained);
- the communicator microbenchmark tables of benchmarks/comm.py
  (latency per message size and backend).

What is fitted, and how:

- compute: `fit_compute_model` (non-negative least squares) on every
  (rank, step) point; jitter σ = the standard deviation of log(measured /
  predicted) over the same points (the model's noise is lognormal, mean one);
- a link: `fit_link`, α + β·MB by non-negative least squares on (MB, ms)
  points; from a bandwidth table, the points are (message MB, latency ms);
- fixed per-category exposure: the means of the exposed columns at W = 1,
  where nothing crosses a link but the collectives' code path still runs.

Forward and backward are NOT fitted separately: the step lines log one
compute time per rank (forward + backward), so the split is the
``forward_fraction`` assumption of the timeline.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from freescale.sim.model import NUM_FEATURES, ComputeModel, LinkModel, fit_compute_model
from freescale.sim.timeline import CATEGORIES, SimConfig, alltoall_ms

# Columns of the measured ``exposed_comm_ms`` and the simulator category they feed.
MEASURED_CATEGORIES = {
    "ids_a2a": "ids",
    "emb_a2a": "emb",
    "grad_a2a": "grad",
    "dense_allreduce": "dense",
    "meta": "meta",
    "balancer": "meta",
}

# Published link figures for tiers we cannot measure here (per GPU, one
# direction). Labelled as such wherever they are used.
PUBLISHED_LINKS = {
    "nvlink-h100": {
        "link": LinkModel(alpha_ms=0.01, beta_ms_per_mb=1.0 / 450.0),
        "source": "NVIDIA H100/H200 SXM datasheet: NVLink 4, 900 GB/s total = 450 GB/s "
        "per direction; alpha 10 us assumed (not measured)",
    },
    "ib-paper": {
        "link": LinkModel(alpha_ms=0.02, beta_ms_per_mb=1.0 / 25.0),
        "source": "FreeScale paper §5: 8 x 200 Gb/s InfiniBand per 8-GPU server = 25 GB/s "
        "per GPU per direction; alpha 20 us assumed (not measured)",
    },
    "ib-ndr400": {
        "link": LinkModel(alpha_ms=0.02, beta_ms_per_mb=1.0 / 50.0),
        "source": "NVIDIA ConnectX-7 NDR: 400 Gb/s = 50 GB/s per GPU per direction; "
        "alpha 20 us assumed (not measured)",
    },
}


def read_steps(path: Path | str) -> list[dict]:
    """The step JSON lines of one run (one dict per step; blank lines skipped)."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                raise ValueError(f"{path}:{n}: not a JSON line") from None
    if not rows or "compute_ms" not in rows[0]:
        raise ValueError(f"{path}: no step lines with compute_ms")
    return rows


def logged_features(rows: list[dict]) -> np.ndarray | None:
    """``[S, W, 5]`` from the lines' ``rank_features``; None if any line lacks it."""
    if not all("rank_features" in r for r in rows):
        return None
    feats = np.asarray([r["rank_features"] for r in rows], dtype=np.float64)
    if feats.ndim != 3 or feats.shape[2] != NUM_FEATURES:
        raise ValueError(f"rank_features must be [W][{NUM_FEATURES}] per line, got {feats.shape}")
    return feats


def compute_times(rows: list[dict]) -> np.ndarray:
    """``[S, W]`` measured per-rank compute ms."""
    return np.asarray([r["compute_ms"] for r in rows], dtype=np.float64)


def exposed_means(rows: list[dict]) -> dict[str, float]:
    """Mean over the given steps of each measured exposed category, mapped onto
    the simulator's categories (balancer and count all-reduce both in meta)."""
    out = dict.fromkeys(sorted(set(MEASURED_CATEGORIES.values())), 0.0)
    for key, cat in MEASURED_CATEGORIES.items():
        out[cat] += float(np.mean([r["exposed_comm_ms"].get(key, 0.0) for r in rows]))
    return out


def jitter_sigma(predicted: np.ndarray, measured: np.ndarray) -> float:
    """σ of log(measured / predicted): the lognormal noise the residuals imply."""
    ratio = np.log(np.asarray(measured, float).ravel() / np.asarray(predicted, float).ravel())
    return float(ratio.std()) if ratio.size > 1 else 0.0


def fit_compute(features: np.ndarray, times_ms: np.ndarray) -> ComputeModel:
    """`ComputeModel` with jitter from ``features[..., 5]`` and matching ``times_ms``."""
    x = np.asarray(features, dtype=np.float64).reshape(-1, NUM_FEATURES)
    y = np.asarray(times_ms, dtype=np.float64).reshape(-1)
    if x.shape[0] != y.shape[0] or x.shape[0] < NUM_FEATURES + 1:
        raise ValueError(f"need >= {NUM_FEATURES + 1} (features, time) points, got {x.shape[0]}")
    if np.any(y <= 0):
        raise ValueError("compute times must be > 0 ms")
    model = fit_compute_model(x, y)
    sigma = jitter_sigma(model.predict(x), y)
    return ComputeModel(*(getattr(model, k) for k in "asbcde"), jitter_sigma=sigma)


def fit_link(mb: np.ndarray, ms: np.ndarray) -> LinkModel:
    """α + β·MB through the points, α, β >= 0 (least squares on the active set)."""
    mb, ms = np.asarray(mb, float).ravel(), np.asarray(ms, float).ravel()
    if mb.size != ms.size or mb.size < 1:
        raise ValueError("fit_link needs as many MB as ms values, at least one")
    x = np.stack([np.ones_like(mb), mb], axis=1)
    best, best_res = (0.0, 0.0), float(ms @ ms)
    for cols in ([0, 1], [0], [1]):
        w, *_ = np.linalg.lstsq(x[:, cols], ms, rcond=None)
        if np.any(w < 0):
            continue
        full = np.zeros(2)
        full[cols] = w
        res = float(np.sum((x @ full - ms) ** 2))
        if res < best_res:
            best, best_res = (float(full[0]), float(full[1])), res
    return LinkModel(*best)


_SIZE = re.compile(r"^(\d+)\s*(KiB|MiB|GiB|B)$")
_UNIT = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def read_bandwidth_tables(text: str) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """``{(op, backend): [(MB per rank, latency ms), ...]}`` from the markdown of
    benchmarks/comm.py (sections ``## <op>: latency us / ...``)."""
    out: dict[tuple[str, str], list[tuple[float, float]]] = {}
    op, backends = None, []
    for line in text.splitlines():
        head = re.match(r"^#+\s*(\w+): latency us", line)
        if head:
            op, backends = head.group(1), []
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if op is None or len(cells) < 2 or set(line.strip()) <= set("|-: "):
            continue
        if cells[0] == "bytes per rank":
            backends = cells[1:]
            continue
        size = _SIZE.match(cells[0])
        if not size or not backends:
            continue
        mb = int(size.group(1)) * _UNIT[size.group(2)] / 1e6
        for backend, cell in zip(backends, cells[1:], strict=False):
            latency_us = float(cell.split("/")[0])
            out.setdefault((op, backend), []).append((mb, latency_us / 1e3))
    return out


def link_from_bandwidth(text: str, op: str, backend: str, min_mb: float = 1.0) -> LinkModel:
    """α–β of one backend's ``op`` from a bandwidth report, messages >= ``min_mb``
    (small messages on a loaded machine measure the scheduler, not the link)."""
    points = read_bandwidth_tables(text).get((op, backend))
    if not points:
        raise ValueError(f"no {op} table for backend {backend!r} in the bandwidth report")
    big = [(mb, ms) for mb, ms in points if mb >= min_mb] or points
    mb, ms = zip(*big, strict=True)
    return fit_link(np.array(mb), np.array(ms))


@dataclass
class Calibration:
    """Everything `SimConfig` and `ComputeModel` need, with where it came from."""

    compute: ComputeModel
    intra: LinkModel
    inter: LinkModel
    fixed_ms: dict[str, float] = field(default_factory=dict)
    fixed_ms_balanced: dict[str, float] = field(default_factory=dict)
    host: dict[str, LinkModel] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Calibration:
        try:
            d = json.loads(text)
            return cls(
                compute=ComputeModel(**d["compute"]),
                intra=LinkModel(**d["intra"]),
                inter=LinkModel(**d["inter"]),
                fixed_ms={k: float(v) for k, v in d.get("fixed_ms", {}).items()},
                fixed_ms_balanced={k: float(v) for k, v in d.get("fixed_ms_balanced", {}).items()},
                host={k: LinkModel(**v) for k, v in d.get("host", {}).items()},
                sources=dict(d.get("sources", {})),
            )
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a calibration file: {e}") from None


@dataclass
class MeasuredRun:
    """One run's post-warm-up step lines with its per-rank features ``[S, W, 5]``."""

    rows: list[dict]
    features: np.ndarray
    balanced: bool = False

    @property
    def world_size(self) -> int:
        return int(self.features.shape[1])


def fit_runs(runs: list[MeasuredRun], inter: LinkModel, row_bytes: int, id_bytes: int = 8):
    """A `Calibration` from measured runs (what `freescale calibrate` and
    benchmarks/sim_validate.py both do):

    - compute + jitter on every (rank, step) point of every run;
    - fixed exposure per category: means of the W = 1 runs (zero without any);
      for balanced runs the ``meta`` entry is the balanced W > 1 runs' mean
      meta + balancer (the count all-reduce is replaced by the balancer);
    - intra link: α–β through (MB the slowest rank moves, exposed ids / emb
      AllToAll minus the W = 1 fixed part) of every W > 1 run, MB from the
      timeline's own volume rule (`alltoall_ms` with α = 0, β = 1).
    """
    if not runs:
        raise ValueError("calibration needs at least one measured run")
    feats = np.concatenate([r.features.reshape(-1, NUM_FEATURES) for r in runs])
    times = np.concatenate([compute_times(r.rows).reshape(-1) for r in runs])
    model = fit_compute(feats, times)
    one = [exposed_means(r.rows) for r in runs if r.world_size == 1]
    fixed = {c: float(np.mean([e[c] for e in one])) if one else 0.0 for c in CATEGORIES}
    balanced = dict(fixed)
    bal = [exposed_means(r.rows)["meta"] for r in runs if r.balanced and r.world_size > 1]
    if bal:
        balanced["meta"] = float(np.mean(bal))
    unit = SimConfig(intra=LinkModel(0.0, 1.0), inter=LinkModel(0.0, 1.0))
    mb, ms = [], []
    for r in runs:
        if r.world_size == 1:
            continue
        ids = r.features[..., 1] + r.features[..., 3] + r.features[..., 4]
        measured = exposed_means(r.rows)
        for cat, nbytes in (("ids", id_bytes), ("emb", row_bytes)):
            mb.append(float(alltoall_ms(ids, nbytes, unit).mean()))
            ms.append(max(0.0, measured[cat] - fixed[cat]))
    intra = fit_link(np.array(mb), np.array(ms)) if mb else LinkModel(0.0, 0.0)
    return Calibration(compute=model, intra=intra, inter=inter, fixed_ms=fixed,
                       fixed_ms_balanced=balanced)  # fmt: skip
