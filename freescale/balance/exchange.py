"""Stage III data movement: ship whole samples by a `Routing`, rebuild the batch.

This is the one place that touches sample data. Grouping by destination and
reordering on arrival are permutations of whole samples, done with the
`freescale.kernels` indexed permute (Triton on GPU) with sizes known on the
host, so nothing is read back from the device.

Only *values* travel, one ``all_to_all_v`` per tensor (UIH features,
candidate features, labels, content features, sample ids, dense): offsets are
rebuilt from the gathered lengths, which every rank already has. A level
whose rows stay where they are on every rank skips its collectives.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import Tensor

from freescale.balance.routing import Routing
from freescale.comm import Communicator, CompletedWork, Work
from freescale.jagged import JaggedFeatures, SampleBatch
from freescale.jagged.ops import gather_positions, host_to_device, lengths_to_offsets
from freescale.kernels import indexed_permute


def schema_fingerprint(batch: SampleBatch) -> int:
    """A 31-bit fingerprint of what a batch carries (feature names, dtypes, row
    shapes, dense or not). Ranks compare it after stage I so that a mismatch
    raises on every rank instead of hanging a collective in stage III."""
    parts = []
    groups = (("uih", batch.uih), ("cand", batch.candidates), ("content", batch.content))
    for group, jf in groups:
        parts += [f"{group}/{n}:{t.dtype}:{tuple(t.shape[1:])}" for n, t in jf.features.items()]
    parts.append(f"labels:{batch.labels.dtype}:{tuple(batch.labels.shape[1:])}")
    parts.append(f"sample_id:{batch.sample_id.dtype}")
    dense = batch.dense
    parts.append("dense:-" if dense is None else f"dense:{dense.dtype}:{tuple(dense.shape[1:])}")
    return zlib.crc32("|".join(parts).encode()) & 0x7FFFFFFF


def _values(jf: JaggedFeatures) -> int | None:
    """Number of values, from a host-known shape (None without features)."""
    return next(iter(jf.features.values())).shape[0] if jf.features else None


def permute_batch(batch: SampleBatch, order: Tensor) -> SampleBatch:
    """``batch.select(order)`` for a *permutation* ``order``, on the kernels.

    Output sizes equal the input's, which are tensor shapes on the host, so
    nothing is read back from the device (``select`` must read a total).
    """
    order = host_to_device(order.to(torch.int64), batch.device)
    n_cand = batch.num_candidates_total
    cand_pos, cand_offsets = gather_positions(batch.candidates.offsets, order, n_cand)
    return SampleBatch(
        uih=indexed_permute(batch.uih, order, _values(batch.uih)),
        candidates=JaggedFeatures(
            cand_offsets, {n: t[cand_pos] for n, t in batch.candidates.features.items()}
        ),
        labels=batch.labels[cand_pos],
        content=indexed_permute(batch.content, cand_pos, _values(batch.content)),
        sample_id=batch.sample_id[order],
        dense=None if batch.dense is None else batch.dense[order],
    )


def _send(comm: Communicator, routing: Routing, level: str, x: Tensor) -> Work:
    if not routing.moving[level]:
        return CompletedWork(x)  # every row of this level stays: ours is what we'd receive
    return comm.all_to_all_v(x, routing.send_counts[level], routing.recv_counts[level])


@dataclass
class PendingExchange:
    """Issued collectives of one stage III; `wait` assembles the balanced batch."""

    routing: Routing
    uih: dict[str, Work]
    candidates: dict[str, Work]
    content: dict[str, Work]
    labels: Work
    sample_id: Work
    dense: Work | None

    def wait(self, stream: torch.Stream | None = None) -> SampleBatch:
        """Wait for every collective (ordering ``stream`` after them on GPU) and
        return the batch in the plan's order."""
        r = self.routing
        sample_id = self.sample_id.wait(stream)
        device = sample_id.device

        def features(works: dict[str, Work], lengths: Tensor) -> JaggedFeatures:
            feats = {n: work.wait(stream) for n, work in works.items()}
            return JaggedFeatures(host_to_device(lengths_to_offsets(lengths), device), feats)

        batch = SampleBatch(
            uih=features(self.uih, r.recv_uih_lengths),
            candidates=features(self.candidates, r.recv_num_candidates),
            labels=self.labels.wait(stream),
            content=features(self.content, r.recv_candidate_lengths),
            sample_id=sample_id,
            dense=None if self.dense is None else self.dense.wait(stream),
        )
        if r.final_order is not None:
            batch = permute_batch(batch, r.final_order)
        return batch


def start_exchange(comm: Communicator, batch: SampleBatch, routing: Routing) -> PendingExchange:
    """Group ``batch`` by destination and issue every tensor's AllToAll.

    Tensors move to ``comm.device`` first if they live elsewhere; the balanced
    batch lives on ``comm.device``.
    """
    if batch.batch_size != sum(routing.send_counts["samples"]):
        raise ValueError(
            f"batch has {batch.batch_size} samples, the routing sends"
            f" {sum(routing.send_counts['samples'])}"
        )
    if batch.device != comm.device:
        batch = batch.to(comm.device)
    if routing.send_order is not None:
        batch = permute_batch(batch, routing.send_order)

    def per_feature(level: str, jf: JaggedFeatures) -> dict[str, Work]:
        return {n: _send(comm, routing, level, t) for n, t in jf.features.items()}

    return PendingExchange(
        routing=routing,
        uih=per_feature("uih", batch.uih),
        candidates=per_feature("candidates", batch.candidates),
        content=per_feature("content", batch.content),
        labels=_send(comm, routing, "candidates", batch.labels),
        sample_id=_send(comm, routing, "samples", batch.sample_id),
        dense=None if batch.dense is None else _send(comm, routing, "samples", batch.dense),
    )
