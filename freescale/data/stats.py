"""Data statistics of the paper's §2: batch sparsity (Eq. 1) and row collisions.

Sparsity is computed per local batch. Collision % compares consecutive
*global* batches (all ranks' item-table lookups: UIH and candidate ids) in
shard-major form: rows are assigned to ``num_shards`` row-wise shards
(contiguous blocks), and for every shard, |I^s ∩ I^(s+1)| / |I^(s+1)| counts
the unique rows step s+1 reads that step s also read — exactly the rows that
must wait for step s's update under prioritized embedding updates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from itertools import pairwise

import numpy as np

from freescale.data.progress import Progress


def batch_sparsity(lengths: np.ndarray) -> float:
    """Paper Eq. 1: the fraction of padding when every sample is padded to the
    batch's longest UIH. An empty batch, or one with only empty UIHs, has none."""
    lengths = np.asarray(lengths)
    if lengths.size == 0 or lengths.max() == 0:
        return 0.0
    return float(1.0 - lengths.sum() / (lengths.max() * lengths.size))


class RowSet:
    """Unique rows of one global batch, as a bitmap (O(1) per id; tables up to ~10^9)."""

    def __init__(self, rows: np.ndarray, num_rows: int) -> None:
        self.mask = np.zeros(num_rows, dtype=bool)
        self.mask[rows] = True
        self.rows = np.flatnonzero(self.mask)


def shard_collisions(prev: RowSet, nxt: RowSet, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """Per shard: (rows of ``nxt`` also in ``prev``, unique rows of ``nxt``)."""
    block = -(-prev.mask.size // num_shards)
    shard = nxt.rows // block
    collide = prev.mask[nxt.rows]
    return (
        np.bincount(shard[collide], minlength=num_shards),
        np.bincount(shard, minlength=num_shards),
    )


@dataclass
class StatsRow:
    batch_size: int
    max_uih: int
    sparsity: float
    collision_pct: float
    max_shard_collision_pct: float
    mean_len: float
    p50_len: float
    p90_len: float
    p99_len: float
    max_len: int
    frac_over_2000: float


class StreamedSamples:
    """A streamed source (`freescale.data.parquet_stream`: one stream per rank)
    numbered like a file source for `collect_stats`: sample ``g`` is sample
    ``i`` of rank ``r``'s batch at global step ``s``, with ``g = (s * W + r) * B + i``."""

    def __init__(self, source, world_size: int, batch_size: int) -> None:
        self.source, self.world_size, self.batch_size = source, world_size, batch_size
        self.num_items = source.num_items

    def raw_sample(self, g: int, max_uih: int | None = None):
        """The sample the run would read (at the source's own ``max_uih``)."""
        step, rest = divmod(g, self.world_size * self.batch_size)
        rank, i = divmod(rest, self.batch_size)
        return self.source.sample_at(step * self.batch_size + i, rank, self.world_size)[1]


def collect_stats(
    source,
    max_uih_list: list[int],
    batch_sizes: list[int],
    world_size: int,
    steps: int | dict[int, int],
    num_shards: int,
    progress: Callable[[str], None] | None = None,
) -> list[StatsRow]:
    """Statistics of ``steps`` global batches of ``source`` per (batch size, max UIH);
    ``steps`` may differ per batch size (a dict), e.g. a whole file at each.

    Each sample is drawn once at the largest max UIH and truncated to the
    smaller ones (keeping its most recent items), as a trainer would. A row
    depends only on its own batch size and max UIH, never on the others asked for.
    """
    steps_of = steps if isinstance(steps, dict) else dict.fromkeys(batch_sizes, steps)
    if min(steps_of[b] for b in batch_sizes) < 2:
        raise ValueError("collision statistics need at least 2 steps")
    if not max_uih_list or min(max_uih_list) < 1 or not batch_sizes or min(batch_sizes) < 1:
        raise ValueError("max UIH lengths and batch sizes must be >= 1")
    say = Progress(progress, unit="step")
    top = max(max_uih_list)
    rows: list[StatsRow] = []
    done, total = 0, sum(steps_of[b] for b in batch_sizes)
    for b in batch_sizes:
        per_step = []
        for step in range(steps_of[b]):
            done += 1
            say(
                f"  batch {b}: global step {step + 1}/{steps_of[b]} ({world_size} ranks)",
                force=step + 1 == steps_of[b],
                done=done,
                total=total,
            )
            first = step * world_size * b
            per_step.append(
                [source.raw_sample(g, top) for g in range(first, first + world_size * b)]
            )
        for m in sorted(max_uih_list):
            rows.append(_row(per_step, b, m, world_size, num_shards, source.num_items))
    return rows


def _row(per_step, b: int, m: int, world_size: int, num_shards: int, num_rows: int) -> StatsRow:
    sparsities, lengths, row_sets = [], [], []
    for samples in per_step:
        lens = np.array([min(s.uih_ids.size, m) for s in samples])
        lengths.append(lens)
        sparsities += [batch_sparsity(lens[r * b : (r + 1) * b]) for r in range(world_size)]
        ids = np.concatenate(
            [s.uih_ids[s.uih_ids.size - n :] for s, n in zip(samples, lens, strict=True)]
            + [s.cand_ids for s in samples]
        )
        row_sets.append(RowSet(ids, num_rows))
    hit = np.zeros(num_shards)
    total = np.zeros(num_shards)
    for prev, nxt in pairwise(row_sets):
        c, n = shard_collisions(prev, nxt, num_shards)
        hit, total = hit + c, total + n
    all_lens = np.concatenate(lengths)
    with np.errstate(invalid="ignore", divide="ignore"):
        per_shard = np.where(total > 0, 100.0 * hit / np.maximum(total, 1), 0.0)
    return StatsRow(
        batch_size=b,
        max_uih=m,
        sparsity=float(np.mean(sparsities)),
        collision_pct=float(100.0 * hit.sum() / max(total.sum(), 1)),
        max_shard_collision_pct=float(per_shard.max()),
        mean_len=float(all_lens.mean()),
        p50_len=float(np.percentile(all_lens, 50)),
        p90_len=float(np.percentile(all_lens, 90)),
        p99_len=float(np.percentile(all_lens, 99)),
        max_len=int(all_lens.max()),
        frac_over_2000=float((all_lens > 2000).mean()),
    )


def format_table(rows: list[StatsRow]) -> str:
    head = (
        f"{'batch':>5} {'max_uih':>7} {'sparsity':>8} {'collide%':>8} {'max_shard%':>10}"
        f" {'mean_len':>8} {'p50':>6} {'p90':>6} {'p99':>6} {'max':>6} {'>2000':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.batch_size:>5} {r.max_uih:>7} {r.sparsity:>8.3f} {r.collision_pct:>8.2f}"
            f" {r.max_shard_collision_pct:>10.2f} {r.mean_len:>8.0f} {r.p50_len:>6.0f}"
            f" {r.p90_len:>6.0f} {r.p99_len:>6.0f} {r.max_len:>6} {r.frac_over_2000:>6.2f}"
        )
    return "\n".join(lines)


def rows_as_dicts(rows: list[StatsRow]) -> list[dict]:
    return [asdict(r) for r in rows]
