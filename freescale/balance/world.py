"""`WorldLengths`: the sizes of every sample of one global step, as every rank sees them.

This is what stages I and II of Algorithm 1 gather (UIH lengths, candidate
counts, composite candidate lengths) and the only data a partitioner may read,
so that every rank computes the same plan from the same inputs.

Global samples are indexed *rank-major*: rank 0's samples in its local order,
then rank 1's, and so on. All tensors here are int64 on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from freescale.jagged import SampleBatch, ops

# Columns of a per-sample (or per-rank, summed) cost-feature row.
FEATURES = ("samples", "uih", "uih_sq", "candidates", "content")
NUM_FEATURES = len(FEATURES)


def _host_int64(t: Tensor, name: str) -> Tensor:
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError(f"{name} must hold integers, got {t.dtype}")
    return t.detach().to(device="cpu", dtype=torch.int64).contiguous()


@dataclass(frozen=True)
class WorldLengths:
    """Per-sample sizes of one global step (G samples over W ranks).

    - ``batch_sizes[r]``: B_r, rank r's local sample count (W entries);
    - ``uih_lengths``: ``[G]`` UIH length L of every global sample;
    - ``num_candidates``: ``[G]`` candidate count N of every global sample;
    - ``candidate_lengths``: ``[sum(N)]`` content length of every candidate
      (L_can), grouped by sample in global order.
    """

    batch_sizes: tuple[int, ...]
    uih_lengths: Tensor
    num_candidates: Tensor
    candidate_lengths: Tensor

    def __post_init__(self) -> None:
        sizes = tuple(int(b) for b in self.batch_sizes)
        if not sizes or min(sizes) < 0:
            raise ValueError(f"batch_sizes must be >= 0 for W >= 1 ranks, got {sizes}")
        uih = _host_int64(self.uih_lengths, "uih_lengths")
        ncand = _host_int64(self.num_candidates, "num_candidates")
        clen = _host_int64(self.candidate_lengths, "candidate_lengths")
        total = sum(sizes)
        if uih.numel() != total or ncand.numel() != total:
            raise ValueError(
                f"{total} samples (sum of batch_sizes) but {uih.numel()} UIH lengths"
                f" and {ncand.numel()} candidate counts"
            )
        if int(ncand.sum()) != clen.numel():
            raise ValueError(
                f"candidate counts sum to {int(ncand.sum())} but there are"
                f" {clen.numel()} candidate lengths"
            )
        for name, t in (
            ("uih_lengths", uih),
            ("num_candidates", ncand),
            ("candidate_lengths", clen),
        ):
            if t.numel() and int(t.min()) < 0:
                raise ValueError(f"{name} must be >= 0")
        object.__setattr__(self, "batch_sizes", sizes)
        object.__setattr__(self, "uih_lengths", uih)
        object.__setattr__(self, "num_candidates", ncand)
        object.__setattr__(self, "candidate_lengths", clen)

    # ---- construction ------------------------------------------------------
    @classmethod
    def from_ranks(
        cls,
        uih_lengths: Sequence[Tensor],
        num_candidates: Sequence[Tensor],
        candidate_lengths: Sequence[Tensor],
    ) -> WorldLengths:
        """From per-rank tensors (rank r's ``[B_r]``, ``[B_r]``, ``[sum N]``)."""
        if not len(uih_lengths) == len(num_candidates) == len(candidate_lengths):
            raise ValueError("need the same number of ranks for every length list")
        if not uih_lengths:
            raise ValueError("need at least one rank")

        def cat(ts: Sequence[Tensor]) -> Tensor:
            return torch.cat([t.detach().cpu().to(torch.int64).reshape(-1) for t in ts])

        return cls(
            tuple(int(t.numel()) for t in uih_lengths),
            cat(uih_lengths),
            cat(num_candidates),
            cat(candidate_lengths),
        )

    @classmethod
    def from_batches(cls, batches: Sequence[SampleBatch]) -> WorldLengths:
        """The world of the given per-rank batches (tests, simulations)."""
        return cls.from_ranks(
            [b.uih_lengths() for b in batches],
            [b.num_candidates() for b in batches],
            [b.candidate_lengths() for b in batches],
        )

    # ---- sizes -------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return len(self.batch_sizes)

    @property
    def total(self) -> int:
        """G, the global sample count."""
        return self.uih_lengths.numel()

    @property
    def total_candidates(self) -> int:
        """Global candidate count (the loss normalizer), known after stage I."""
        return self.candidate_lengths.numel()

    def rank_offsets(self) -> Tensor:
        """``[W + 1]``: rank r's samples are global ``[off[r], off[r + 1])``."""
        return ops.lengths_to_offsets(torch.tensor(self.batch_sizes, dtype=torch.int64))

    def source_ranks(self) -> Tensor:
        """``[G]``: the rank each global sample starts on."""
        sizes = torch.tensor(self.batch_sizes, dtype=torch.int64)
        return torch.repeat_interleave(torch.arange(self.world_size), sizes)

    def candidate_offsets(self) -> Tensor:
        """``[G + 1]``: candidates of sample g are ``candidate_lengths[off[g]:off[g+1]]``."""
        return ops.lengths_to_offsets(self.num_candidates)

    def content_per_sample(self) -> Tensor:
        """``[G]``: total content length of each sample's candidates (sum of L_can)."""
        prefix = ops.lengths_to_offsets(self.candidate_lengths)
        offs = self.candidate_offsets()
        return prefix[offs[1:]] - prefix[offs[:-1]]

    def candidate_lengths_of(self, samples: Tensor) -> Tensor:
        """Content lengths of the candidates of ``samples`` (global indices, in order)."""
        positions, _ = ops.gather_positions(self.candidate_offsets(), samples)
        return self.candidate_lengths[positions]


def sample_features(world: WorldLengths) -> Tensor:
    """``[G, 5]`` float64 cost features of every sample: 1, L, L², N, sum(L_can)."""
    uih = world.uih_lengths.to(torch.float64)
    return torch.stack(
        [
            torch.ones_like(uih),
            uih,
            uih * uih,
            world.num_candidates.to(torch.float64),
            world.content_per_sample().to(torch.float64),
        ],
        dim=1,
    )


def batch_features(batch: SampleBatch) -> Tensor:
    """``[5]`` float64: the summed cost features of one local batch (host read)."""
    world = WorldLengths.from_batches([batch])
    return sample_features(world).sum(dim=0)
