"""Shared training scenario of the embedding tests: sharded run and plain reference.

A fixed sequence of *global* batches (independent of the world size) is split
unevenly over the ranks (one rank gets no samples at each step). Loss per
position: ``w_sample * 0.5 * ||e - target[id]||^2``, normalized by the global
number of samples, so the sharded update must not depend on the split.
"""

from __future__ import annotations

import io
from typing import Any

import torch
from torch import Tensor

from freescale.comm import Communicator
from freescale.embedding import (
    SGD,
    Adam,
    RowwiseAdagrad,
    ShardedEmbeddingCollection,
    ShardingPlan,
    TableConfig,
)
from freescale.jagged import JaggedTensor
from freescale.testing.tolerance import adam_step_bound, steps_tol

# feature -> (table, max length per sample)
FEATURES = {"uih": ("items", 7), "cand": ("items", 3), "act": ("actions", 7), "c2": ("cands", 2)}
SAMPLES = 12


def tables(optimizer: str) -> list[TableConfig]:
    opt = make_optimizer(optimizer)
    return [
        TableConfig("items", 97, 8, optimizer=opt, feature_names=("uih", "cand")),
        TableConfig("actions", 13, 8, optimizer=opt, feature_names=("act",)),
        TableConfig("cands", 41, 4, optimizer=opt, feature_names=("c2",)),
    ]


def make_optimizer(name: str):
    if name == "sgd":
        return SGD(lr=0.3, lr_schedule=_decay)
    if name == "adagrad":
        return RowwiseAdagrad(lr=0.2, eps=1e-6, initial_accumulator=0.01)
    if name == "adam":
        return Adam(lr=0.05, beta1=0.8, beta2=0.95, eps=1e-6)
    if name == "adagrad_l2":  # decay reads the row itself: still a per-row update
        return RowwiseAdagrad(lr=0.2, eps=1e-6, initial_accumulator=0.01, weight_decay=0.1)
    raise ValueError(name)


def _decay(step: int) -> float:
    return 0.3 / (1.0 + 0.1 * step)


def initial_tables() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {t.name: torch.randn(t.rows, t.dim, generator=g) for t in tables("sgd")}


def targets() -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(99)
    return {t.name: torch.randn(t.rows, t.dim, generator=g) for t in tables("sgd")}


def global_batch(step: int) -> tuple[dict[str, tuple[Tensor, Tensor]], Tensor]:
    """Per feature: (per-sample lengths [S], ids); and per-sample loss weights [S]."""
    g = torch.Generator().manual_seed(1000 + step)
    batch = {}
    rows = {t.name: t.rows for t in tables("sgd")}
    uih_lengths = torch.randint(0, 8, (SAMPLES,), generator=g)
    for feature, (table, max_len) in FEATURES.items():
        if feature == "act":
            lengths = uih_lengths  # shares the UIH offsets, like action types
        else:
            lengths = torch.randint(0, max_len + 1, (SAMPLES,), generator=g)
        n = int(lengths.sum())
        # Squaring skews ids towards 0: many duplicates, hot rows.
        ids = (torch.rand(n, generator=g) ** 2 * rows[table]).long().clamp_max(rows[table] - 1)
        batch[feature] = (lengths, ids)
    weights = torch.rand(SAMPLES, generator=g) + 0.5
    return batch, weights


def split_sizes(step: int, world_size: int) -> list[int]:
    """Uneven samples per rank; rank ``step % W`` gets none (when W > 1)."""
    if world_size == 1:
        return [SAMPLES]
    share = [(r - step) % world_size for r in range(world_size)]
    sizes = [SAMPLES * s // sum(share) for s in share]
    sizes[share.index(max(share))] += SAMPLES - sum(sizes)
    return sizes


def local_batch(step: int, rank: int, world_size: int):
    """This rank's slice of the global batch: features (jagged) and per-id weights."""
    batch, weights = global_batch(step)
    sizes = split_sizes(step, world_size)
    lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
    features, id_weights = {}, {}
    for feature, (lengths, ids) in batch.items():
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        a, b = int(offsets[lo]), int(offsets[hi])
        features[feature] = JaggedTensor.from_lengths(ids[a:b], lengths[lo:hi])
        id_weights[feature] = torch.repeat_interleave(weights[lo:hi], lengths[lo:hi])
    return features, id_weights


def loss_of(outputs: dict, id_weights: dict, feature_table: dict, tgt: dict, ids: dict) -> Tensor:
    total = torch.zeros(())
    for feature, emb in outputs.items():
        values = emb.values if isinstance(emb, JaggedTensor) else emb
        diff = values - tgt[feature_table[feature]][ids[feature]]
        total = total + (id_weights[feature] * 0.5 * diff.pow(2).sum(1)).sum()
    return total / SAMPLES


def make_collection(
    comm: Communicator, optimizer: str, plan_kwargs: dict, seed: int = 0, **kwargs: Any
):
    """The test tables; ``kwargs`` (mode, timer, ...) go to the collection."""
    coll = ShardedEmbeddingCollection(
        tables(optimizer), comm, ShardingPlan(**plan_kwargs), device=comm.device, seed=seed,
        **kwargs,
    )  # fmt: skip
    for name, w in initial_tables().items():
        coll.set_table(name, w)
    return coll


def train_sharded(comm: Communicator, optimizer: str, steps: int, plan_kwargs: dict) -> dict:
    """Train the sharded collection; return full tables, states, steps and local losses."""
    coll = make_collection(comm, optimizer, plan_kwargs)
    losses = run_steps(coll, comm, range(steps))
    return {"tables": snapshot(coll), "losses": losses}


def run_steps(coll: ShardedEmbeddingCollection, comm: Communicator, steps) -> list[float]:
    tgt = targets()
    feature_table = {f: t for f, (t, _) in FEATURES.items()}
    losses = []
    for step in steps:
        features, id_weights = local_batch(step, comm.rank, comm.world_size)
        features = {
            k: JaggedTensor(v.values.to(comm.device), v.offsets.to(comm.device))
            for k, v in features.items()
        }
        out = coll(features)
        ids = {k: v.values.cpu() for k, v in features.items()}
        out_cpu = {k: v.values.cpu() for k, v in out.items()}
        loss = loss_of(out_cpu, id_weights, feature_table, tgt, ids)
        loss.backward()
        losses.append(loss.item())
    return losses


def snapshot(coll: ShardedEmbeddingCollection) -> dict:
    return {
        name: {
            "weight": coll.full_table(name).cpu(),
            "state": {k: v.cpu() for k, v in coll.full_optimizer_state(name).items()},
            "step": coll.step_of(name),
        }
        for name in coll.tables
    }


# ---- the unsharded reference: plain tensors, same math ------------------------


def reference(optimizer: str, steps: int) -> dict:
    """Single-process training on the global batches with dense tensors."""
    weights = initial_tables()
    cfgs = {t.name: t for t in tables(optimizer)}
    state = {name: _ref_state(optimizer, w) for name, w in weights.items()}
    tgt = targets()
    losses = []
    # The sizes the parity tolerance derives from (`parity_tol`).
    stats = {"terms": 1, "grad": 0.0, "loss_terms": 1, "loss": 0.0}
    for step in range(steps):
        batch, sample_w = global_batch(step)
        loss = 0.0
        grads = {name: torch.zeros_like(w) for name, w in weights.items()}
        touched = {name: [] for name in weights}
        counts = {name: torch.zeros(w.shape[0], dtype=torch.int64) for name, w in weights.items()}
        for feature, (lengths, ids) in batch.items():
            table = FEATURES[feature][0]
            w_ids = torch.repeat_interleave(sample_w, lengths)
            diff = weights[table][ids] - tgt[table][ids]
            loss += float((w_ids * 0.5 * diff.pow(2).sum(1)).sum()) / SAMPLES
            g = w_ids[:, None] * diff / SAMPLES
            grads[table].index_add_(0, ids, g)
            touched[table].append(ids)
            counts[table] += torch.bincount(ids, minlength=weights[table].shape[0])
            stats["loss_terms"] = max(stats["loss_terms"], ids.numel() * diff.shape[1])
        stats["terms"] = max(stats["terms"], *(int(c.max()) for c in counts.values()))
        stats["grad"] = max(stats["grad"], *(float(g.abs().max()) for g in grads.values()))
        stats["loss"] = max(stats["loss"], loss)
        for name in weights:
            rows = torch.unique(torch.cat(touched[name]))
            _ref_update(
                optimizer,
                cfgs[name].optimizer,
                weights[name],
                state[name],
                rows,
                grads[name][rows],
                step + 1,
            )
        losses.append(loss)
    tables_out = {
        name: {"weight": weights[name], "state": state[name], "step": steps} for name in weights
    }
    return {"tables": tables_out, "losses": losses, "stats": stats}


def parity_tol(optimizer: str, steps: int, stats: dict) -> dict[str, dict[str, float]]:
    """Tolerances of sharded training against `reference` over ``steps`` steps.

    The runs differ in the order of each row's duplicate sum (arrival order,
    chunked, per rank) and of the loss's partial sums. A row's gradient terms
    ``w_sample · (e - target) / SAMPLES`` share a sign per element (one row,
    one target), so its rounding error is relative; the optimizer's step
    carries it with its largest step as the size (`steps_tol`). The state
    holds ``g`` and ``g²``; the loss is a sum of positive terms.
    """
    opt = make_optimizer(optimizer)
    dim = max(t.dim for t in tables(optimizer))
    if optimizer == "sgd":
        step = max(opt.lr_schedule(s) for s in range(1, steps + 1)) * stats["grad"]
    elif optimizer == "adagrad":
        step = opt.lr * dim**0.5  # |g_j| / sqrt(mean(g²)) <= sqrt(dim)
    else:
        step = opt.lr * max(adam_step_bound(opt.beta1, opt.beta2, s) for s in range(1, steps + 1))
    g = stats["grad"]
    return {
        "weight": steps_tol(torch.float32, stats["terms"], step, steps, depth=2),
        "state": steps_tol(torch.float32, stats["terms"], max(g, g * g), steps, depth=2),
        "loss": steps_tol(torch.float32, stats["loss_terms"], stats["loss"], steps, depth=2),
    }


def _ref_state(optimizer: str, w: Tensor) -> dict[str, Tensor]:
    if optimizer == "adagrad":
        return {"sum_sq": torch.full((w.shape[0],), 0.01)}
    if optimizer == "adam":
        return {"exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w)}
    return {}


def _ref_update(name, opt, w, state, rows, g, step) -> None:
    if name == "sgd":
        w[rows] -= opt.lr_schedule(step) * g
    elif name == "adagrad":
        state["sum_sq"][rows] += (g * g).mean(1)
        w[rows] -= opt.lr * g / (state["sum_sq"][rows].sqrt()[:, None] + opt.eps)
    else:
        m = state["exp_avg"][rows] * opt.beta1 + (1 - opt.beta1) * g
        v = state["exp_avg_sq"][rows] * opt.beta2 + (1 - opt.beta2) * g * g
        state["exp_avg"][rows], state["exp_avg_sq"][rows] = m, v
        m_hat = m / (1 - opt.beta1**step)
        v_hat = v / (1 - opt.beta2**step)
        w[rows] -= opt.lr * m_hat / (v_hat.sqrt() + opt.eps)


def pack(obj) -> bytes:
    """Serialize a result holding tensors for `run_ranks`.

    Its result queue would otherwise share tensor storage through file
    descriptors of a rank process that has already exited.
    """
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def unpack(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)
