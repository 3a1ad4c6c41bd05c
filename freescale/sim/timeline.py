"""One synchronous training step per row: step time, straggler %, exposed communication.

Input: ``features[S, W, 5]`` (per step, per rank, the summed batch features of
`freescale.sim.model.FEATURES`). Each rank's compute C_r comes from a
`ComputeModel` (with its seeded jitter); communication volumes come from the
ids each rank looks up (ΣL + candidates + content). Everything is computed for
all steps and ranks at once (numpy arrays ``[S]`` and ``[S, W]``): no Python
loop over steps or ranks.

Step structure (every rank, in this order; the step starts with all ranks
aligned, because the previous step ended on a blocking collective):

1. ids AllToAll, 2. embedding AllToAll (rows to the requesters),
3. forward + backward compute C_r (a share ``forward_fraction`` is forward),
4. gradient AllToAll (row gradients back to the owners),
5. the exposed tail of the dense all-reduce.

Two measured effects ride on top (both calibrated from runs, docs/simulator.md):

- ``fixed_ms[cat]``: a constant every rank is exposed to in a category every
  step, whatever W: the collectives' own code path (measured at W = 1, where
  nothing moves but the dispatch/lookup/copy work still sits on the compute
  stream), the balancer's exposed section, the count all-reduce (``meta``).
- ``forward_barrier``: unbalanced runs all-reduce the global candidate count
  between forward and backward (the loss denominator), so the forward's
  imbalance is waited out there (category ``meta``) and the backward's at the
  gradient AllToAll: the step pays max fwd + max bwd, not max (fwd + bwd).
  Forward and backward then get independent jitter draws, each with σ scaled
  by 1/sqrt(f² + (1 − f)²) so that the total's spread stays σ.

A blocking collective starts when the last rank reaches it and lasts X, the
slowest rank's transfer time; rank r's exposed time in it is
(max_q arrival_q − arrival_r) + X. Only step 4 follows unequal compute, so the
wait for the straggler lands in the gradient category, as in the measured
runs; the slowest rank waits exactly X there.

Mode assumptions (`freescale/pipeline/schedule.py`, docs/embedding.md):

- ``sync``: ids, embedding and gradient AllToAll all blocking.
- ``sdd``: the ids AllToAll of step i+1 is issued once every rank finished
  step i's forward and runs during the rest of step i (window
  W_i = (1 − f)·max C + blocking grad + dense tail); it exposes only
  max(0, X_ids − W_{i−1}). Embedding and gradient AllToAll blocking.
- ``freescale``: the ids and the embedding rows private to a rank (share
  1 − κ, κ = ``collision_share``) are prefetched in the same window, ids
  first; the gradients of private rows are applied off the critical path
  (assumed hidden). Only the colliding share κ of the embedding and gradient
  AllToAll is blocking.
- Dense all-reduce (ring, 2(W−1)/W of the dense bytes on the slowest tier
  in use): overlapped with backward except ``dense_tail`` of it.
- Step 0 of the overlapped modes uses its own window as the previous one
  (steady state). No link contention between overlapped and blocking
  transfers; no balancer or meta (count all-reduce) time; no data wait.

Volumes: rank r sends its ids to the row owners, uniformly spread over the W
ranks (row-wise sharding of hashed rows); the share for itself moves nothing.
Peers on the same node (``gpus_per_node``) use the intra link, the others the
inter link; both run concurrently and each direction of a full-duplex link is
counted separately, so rank r's time is max over tiers of the link time of
max(sent, received) bytes. Embedding rows and gradients are ``dim ×
dtype_bytes`` per looked-up id. The latency α is paid once per tier per
collective (grouped sends), not once per peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from freescale.sim.model import NUM_FEATURES, ComputeModel, LinkModel

MODES = ("sync", "sdd", "freescale")
CATEGORIES = ("ids", "emb", "grad", "dense", "meta")


@dataclass(frozen=True)
class SimConfig:
    """Mode, links and volumes of a simulated run (see the module docstring)."""

    mode: str = "sync"
    intra: LinkModel = field(default_factory=lambda: LinkModel(0.02, 0.005))
    inter: LinkModel = field(default_factory=lambda: LinkModel(0.05, 0.02))
    gpus_per_node: int = 8
    bytes_per_id: int = 8
    embedding_dim: int = 256
    embedding_bytes: int = 4
    dense_mb: float = 0.0
    dense_tail: float = 0.1
    collision_share: float = 0.213
    forward_fraction: float = 1.0 / 3.0
    fixed_ms: dict[str, float] = field(default_factory=dict)
    forward_barrier: bool = False

    def __post_init__(self) -> None:
        for cat, ms in self.fixed_ms.items():
            if cat not in CATEGORIES or not (np.isfinite(ms) and ms >= 0):
                raise ValueError(f"fixed_ms: categories {CATEGORIES}, ms >= 0; got {cat}={ms}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.gpus_per_node < 1 or self.bytes_per_id < 0 or self.embedding_dim < 0:
            raise ValueError("need gpus_per_node >= 1, bytes_per_id >= 0, embedding_dim >= 0")
        if self.embedding_bytes < 0 or self.dense_mb < 0:
            raise ValueError("need embedding_bytes >= 0 and dense_mb >= 0")
        for name in ("dense_tail", "collision_share", "forward_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in [0, 1], got {getattr(self, name)}")

    @property
    def row_bytes(self) -> int:
        return self.embedding_dim * self.embedding_bytes


@dataclass(frozen=True)
class StepTimes:
    """Per-step results: ``step_ms``, ``straggler_pct``, ``qps``, ``items`` are
    ``[S]``; ``compute_ms`` is ``[S, W]``; ``exposed_ms[cat]`` is ``[S]``, the
    mean over ranks (as the measured tables report it). ``blocking_ms[cat]`` is
    the part every rank waits (``[S]``): rank r's exposure is that plus, for
    ``grad``, its wait for the slowest rank (`rank_exposed_ms`)."""

    step_ms: np.ndarray
    compute_ms: np.ndarray
    exposed_ms: dict[str, np.ndarray]
    blocking_ms: dict[str, np.ndarray]
    straggler_pct: np.ndarray
    qps: np.ndarray
    items: np.ndarray
    wait_ms: dict[str, np.ndarray]

    def rank_exposed_ms(self, category: str) -> np.ndarray:
        """``[S, W]``: each rank's exposed ms in ``category``."""
        out = np.repeat(self.blocking_ms[category][:, None], self.compute_ms.shape[1], axis=1)
        if category in self.wait_ms:
            out = out + self.wait_ms[category]
        return out

    def summary(self, skip: int = 0) -> dict[str, float]:
        """Means over steps ``skip..``: step ms, compute ms (mean rank), QPS,
        straggler %, exposed ms per category."""
        sl = slice(skip, None)
        out = {
            "step_ms": float(self.step_ms[sl].mean()),
            "compute_ms": float(self.compute_ms[sl].mean()),
            "qps": float(self.items[sl].sum() / (self.step_ms[sl].sum() / 1e3)),
            "straggler_pct": float(self.straggler_pct[sl].mean()),
        }
        for cat in CATEGORIES:
            out[f"{cat}_ms"] = float(self.exposed_ms[cat][sl].mean())
        return out


def alltoall_ms(ids: np.ndarray, bytes_per_id: float, cfg: SimConfig) -> np.ndarray:
    """``[S]``: duration of an AllToAll moving ``bytes_per_id`` per looked-up id,
    ``ids[S, W]`` ids per rank: the slowest rank's transfer time."""
    s, w = ids.shape
    g = min(cfg.gpus_per_node, w)
    if w % g:
        raise ValueError(f"world size {w} is not a multiple of gpus_per_node {g}")
    node_sum = ids.reshape(s, w // g, g).sum(axis=2).repeat(g, axis=1)  # [S, W]
    total = ids.sum(axis=1, keepdims=True)
    mb = bytes_per_id / 1e6
    intra = np.maximum(ids * (g - 1) / w, (node_sum - ids) / w) * mb
    inter = np.maximum(ids * (w - g) / w, (total - node_sum) / w) * mb
    per_rank = np.maximum(cfg.intra.time_ms(intra), cfg.inter.time_ms(inter))
    return per_rank.max(axis=1)


def allreduce_ms(world_size: int, cfg: SimConfig) -> float:
    """Ring all-reduce of the dense parameters on the slowest tier in use."""
    if world_size == 1 or cfg.dense_mb == 0:
        return 0.0
    link = cfg.inter if world_size > cfg.gpus_per_node else cfg.intra
    return float(link.time_ms(2.0 * (world_size - 1) / world_size * cfg.dense_mb))


def simulate(features: np.ndarray, model: ComputeModel, cfg: SimConfig, seed: int = 0) -> StepTimes:
    """Simulate ``features[S, W, 5]`` under ``cfg.mode`` (module docstring)."""
    features = np.asarray(features, dtype=np.float64)
    if features.ndim != 3 or features.shape[2] != NUM_FEATURES or 0 in features.shape[:2]:
        raise ValueError(f"features must be [steps, ranks, {NUM_FEATURES}], got {features.shape}")
    rng = np.random.default_rng(seed)
    f = cfg.forward_fraction
    if cfg.forward_barrier:  # two phases, each waited out at its own barrier
        mean = model.predict(features)
        scale = 1.0 / np.sqrt(f * f + (1.0 - f) ** 2)
        fwd = f * mean * _jitter(rng, model.jitter_sigma * scale, mean.shape)
        bwd = (1.0 - f) * mean * _jitter(rng, model.jitter_sigma * scale, mean.shape)
        compute = fwd + bwd
        max_fwd, max_bwd = fwd.max(axis=1), bwd.max(axis=1)
    else:
        compute = model.sample(features, rng)  # [S, W]
        max_fwd, max_bwd = f * compute.max(axis=1), (1.0 - f) * compute.max(axis=1)
    ids = features[..., 1] + features[..., 3] + features[..., 4]
    items = (features[..., 1] + features[..., 3]).sum(axis=1)
    x_ids = alltoall_ms(ids, cfg.bytes_per_id, cfg)
    x_rows = alltoall_ms(ids, cfg.row_bytes, cfg)  # embedding rows and row gradients
    tail = np.full_like(x_ids, cfg.dense_tail * allreduce_ms(features.shape[1], cfg))
    kappa = cfg.collision_share if cfg.mode == "freescale" else 1.0
    grad = kappa * x_rows
    blocking = {"emb": kappa * x_rows, "grad": grad, "dense": tail, "meta": np.zeros_like(tail)}
    if cfg.mode == "sync":
        blocking["ids"] = x_ids
    else:
        window = max_bwd + grad + tail
        prev = np.concatenate([window[:1], window[:-1]])
        blocking["ids"] = np.maximum(0.0, x_ids - prev)
        if cfg.mode == "freescale":  # private rows fetched after the ids, same window
            fetched = np.maximum(0.0, x_ids + (1.0 - kappa) * x_rows - prev)
            blocking["emb"] = blocking["emb"] + fetched - blocking["ids"]
    for cat, ms in cfg.fixed_ms.items():
        blocking[cat] = blocking[cat] + ms
    step = sum(blocking[cat] for cat in CATEGORIES) + max_fwd + max_bwd
    if cfg.forward_barrier:
        fwd_wait, bwd_wait = max_fwd[:, None] - fwd, max_bwd[:, None] - bwd
    else:
        fwd_wait, bwd_wait = np.zeros_like(compute), compute.max(axis=1, keepdims=True) - compute
    exposed = {cat: blocking[cat].copy() for cat in CATEGORIES}
    exposed["meta"] = blocking["meta"] + fwd_wait.mean(axis=1)
    exposed["grad"] = blocking["grad"] + bwd_wait.mean(axis=1)
    straggler = compute.max(axis=1, keepdims=True) - compute
    return StepTimes(
        step_ms=step,
        compute_ms=compute,
        exposed_ms=exposed,
        blocking_ms={cat: blocking[cat] for cat in CATEGORIES},
        straggler_pct=100.0 * straggler.mean(axis=1) / step,
        qps=items / (step / 1e3),
        items=items,
        wait_ms={"meta": fwd_wait, "grad": bwd_wait},
    )


def _jitter(rng: np.random.Generator, sigma: float, shape: tuple[int, ...]) -> np.ndarray:
    """Mean-one lognormal factors exp(σZ − σ²/2); ones when σ = 0."""
    if sigma == 0.0:
        return np.ones(shape)
    return np.exp(sigma * rng.standard_normal(shape) - 0.5 * sigma * sigma)
