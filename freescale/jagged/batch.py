"""`SampleBatch`: one rank's batch of samples in batch-major jagged form."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from freescale.jagged.tensor import JaggedFeatures, _same

# Names the reference model, data sources and balancer agree on.
UIH_IDS = "item_ids"
UIH_ACTIONS = "actions"
UIH_TIMESTAMPS = "timestamps"
CAND_IDS = "item_ids"
CONTENT_IDS = "content_ids"


@dataclass
class SampleBatch:
    """A batch of B samples, each with

    - a user interaction history (UIH): features in ``uih`` (B segments, one
      shared offsets), e.g. item ids, action types, timestamps;
    - N_i candidates: features in ``candidates`` (B segments) and one label per
      candidate in ``labels``;
    - per candidate, a variable-size content list: ``content`` has one segment
      per candidate (``sum(N_i)`` segments), the paper's composite candidate
      lengths L_can;
    - optional ``dense`` features ``[B, D]``;
    - ``sample_id``: a global id, so tests can prove nothing was lost or duplicated;
    - ``max_lengths``: (longest UIH, most candidates of a sample) as host ints,
      when the loader knows them: kernels that size their launch by them
      (varlen attention) then never read them back from the device. Moving
      the batch keeps them; selecting samples drops them.
    """

    uih: JaggedFeatures
    candidates: JaggedFeatures
    labels: Tensor
    content: JaggedFeatures
    sample_id: Tensor
    dense: Tensor | None = None
    max_lengths: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        b = self.sample_id.shape[0]
        if self.sample_id.dim() != 1:
            raise ValueError("sample_id must be 1-D [B]")
        if self.uih.num_segments != b or self.candidates.num_segments != b:
            raise ValueError(
                f"uih ({self.uih.num_segments}) and candidates ({self.candidates.num_segments})"
                f" must have one segment per sample ({b})"
            )
        n_cand = self.labels.shape[0]
        if self.labels.dim() != 1:
            raise ValueError("labels must be 1-D, one per candidate")
        if self.content.num_segments != n_cand:
            raise ValueError(
                f"content has {self.content.num_segments} segments, expected one per candidate"
                f" ({n_cand})"
            )
        for name, t in self.candidates.features.items():
            if t.shape[0] != n_cand:
                raise ValueError(
                    f"candidate feature {name!r} has {t.shape[0]} rows, labels {n_cand}"
                )
        if self.dense is not None and (self.dense.dim() != 2 or self.dense.shape[0] != b):
            raise ValueError(f"dense must be [B, D] with B={b}, got {tuple(self.dense.shape)}")

    # ---- sizes -------------------------------------------------------------
    @property
    def batch_size(self) -> int:
        return self.sample_id.shape[0]

    @property
    def num_candidates_total(self) -> int:
        return self.labels.shape[0]

    @property
    def device(self) -> torch.device:
        return self.sample_id.device

    def uih_lengths(self) -> Tensor:
        return self.uih.lengths()

    def num_candidates(self) -> Tensor:
        return self.candidates.lengths()

    def candidate_lengths(self) -> Tensor:
        """Content length of every candidate (the paper's L_can), ``[sum(N_i)]``."""
        return self.content.lengths()

    def validate(self) -> None:
        """Check every offsets against its values (reads device memory on GPU)."""
        self.uih.validate("uih")
        self.candidates.validate("candidates")
        self.content.validate("candidate content")
        if int(self.candidates.offsets[-1]) != self.labels.shape[0]:
            raise ValueError("candidate offsets do not match the number of labels")

    def with_max_lengths(self, max_uih: int, max_candidates: int) -> SampleBatch:
        """This batch, told its longest UIH and most candidates per sample."""
        return replace(self, max_lengths=(max_uih, max_candidates))

    # ---- selection ---------------------------------------------------------
    def select(self, indices: Tensor) -> SampleBatch:
        """Samples ``indices`` (any order, repeats allowed), as a new batch."""
        indices = indices.to(device=self.device, dtype=torch.int64)
        uih = self.uih.select(indices)
        cands, cand_pos = self.candidates.select_with_positions(indices)
        return SampleBatch(
            uih=uih,
            candidates=cands,
            labels=self.labels[cand_pos],
            content=self.content.select(cand_pos),
            sample_id=self.sample_id[indices],
            dense=None if self.dense is None else self.dense[indices],
        )

    def slice(self, start: int, stop: int) -> SampleBatch:
        """Samples ``[start, stop)`` without gathering (views)."""
        c_lo, c_hi = int(self.candidates.offsets[start]), int(self.candidates.offsets[stop])
        return SampleBatch(
            uih=self.uih.slice(start, stop),
            candidates=self.candidates.slice(start, stop),
            labels=self.labels[c_lo:c_hi],
            content=self.content.slice(c_lo, c_hi),
            sample_id=self.sample_id[start:stop],
            dense=None if self.dense is None else self.dense[start:stop],
        )

    def split_by_dest(self, dest: Tensor, world_size: int) -> list[SampleBatch]:
        """One batch per destination rank; samples keep their relative order."""
        dest = dest.to(device=self.device, dtype=torch.int64)
        if dest.shape != (self.batch_size,):
            raise ValueError(f"dest must have one entry per sample ({self.batch_size})")
        if self.batch_size and (int(dest.min()) < 0 or int(dest.max()) >= world_size):
            raise ValueError(f"dest values must lie in [0, {world_size})")
        order = torch.sort(dest, stable=True).indices
        grouped = self.select(order)
        counts = torch.bincount(dest, minlength=world_size).tolist()
        pieces, start = [], 0
        for n in counts:
            pieces.append(grouped.slice(start, start + n))
            start += n
        return pieces

    @staticmethod
    def concat(batches: list[SampleBatch]) -> SampleBatch:
        """Samples of ``batches`` laid end to end (``from_samples``)."""
        if not batches:
            raise ValueError("cannot concatenate zero batches")
        denses = [b.dense for b in batches]
        if any(d is None for d in denses) and not all(d is None for d in denses):
            raise ValueError("either all batches carry dense features or none do")
        return SampleBatch(
            uih=JaggedFeatures.concat([b.uih for b in batches]),
            candidates=JaggedFeatures.concat([b.candidates for b in batches]),
            labels=torch.cat([b.labels for b in batches]),
            content=JaggedFeatures.concat([b.content for b in batches]),
            sample_id=torch.cat([b.sample_id for b in batches]),
            dense=None if denses[0] is None else torch.cat(denses),  # type: ignore[arg-type]
        )

    from_samples = concat

    # ---- device movement ---------------------------------------------------
    def _map(self, fn: Callable[[Tensor], Tensor]) -> SampleBatch:
        return SampleBatch(
            uih=self.uih.map(fn),
            candidates=self.candidates.map(fn),
            labels=fn(self.labels),
            content=self.content.map(fn),
            sample_id=fn(self.sample_id),
            dense=None if self.dense is None else fn(self.dense),
            max_lengths=self.max_lengths,
        )

    def tensors(self) -> Iterator[Tensor]:
        yield from self.uih.tensors()
        yield from self.candidates.tensors()
        yield self.labels
        yield from self.content.tensors()
        yield self.sample_id
        if self.dense is not None:
            yield self.dense

    @staticmethod
    def from_tensors(
        tensors: Iterator[Tensor],
        uih: Sequence[str],
        candidates: Sequence[str],
        content: Sequence[str],
        has_dense: bool,
    ) -> SampleBatch:
        """The batch whose `tensors` are ``tensors`` (in that order), given its
        feature names."""

        def jagged(names: Sequence[str]) -> JaggedFeatures:
            offsets = next(tensors)
            return JaggedFeatures(offsets, {n: next(tensors) for n in names})

        return SampleBatch(
            uih=jagged(uih),
            candidates=jagged(candidates),
            labels=next(tensors),
            content=jagged(content),
            sample_id=next(tensors),
            dense=next(tensors) if has_dense else None,
        )

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SampleBatch:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> SampleBatch:
        """Page-locked copy for async H2D; unchanged where no accelerator exists
        (as `torch.utils.data.DataLoader` does), so CPU-only runs still work."""
        if not torch.cuda.is_available():
            return self
        return self._map(lambda t: t.pin_memory())

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Tell the caching allocator these tensors are used on ``stream`` too."""
        for t in self.tensors():
            t.record_stream(stream)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    # ---- comparison --------------------------------------------------------
    def equal(self, other: SampleBatch) -> bool:
        """Exact equality of every tensor, dtype and feature name."""
        if (self.dense is None) != (other.dense is None):
            return False
        return (
            self.uih.equal(other.uih)
            and self.candidates.equal(other.candidates)
            and _same(self.labels, other.labels)
            and self.content.equal(other.content)
            and _same(self.sample_id, other.sample_id)
            and (self.dense is None or _same(self.dense, other.dense))  # type: ignore[arg-type]
        )
