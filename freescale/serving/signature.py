"""The flat tensor signature of an exported model: what a serving stack passes.

An exported program takes plain tensors, never a `SampleBatch`. Per level
(``uih``, ``candidates``, ``content``) its offsets, then each of its features'
values in the signature's order; then ``dense`` (``[B, D]``, when the data
has dense features); then two *width* tensors whose lengths are the longest
history and the most candidates of a sample (their values are never read).

Why widths as tensor lengths: a padded attention needs its width as a size.
Read from the offsets inside the program (``lengths.max()``), it would be a
data-dependent size that every later shape check has to be proven against; as
the length of an input it is an ordinary dynamic dimension, checked when the
program is called. `flatten` computes them (one host read of the offsets).

Labels and sample ids are not inputs: a served request has none. The program
gives every candidate label 0 and every sample its index (models must not
read labels in ``forward``; the contract's samples are independent).

Dynamic dimensions: samples ``B`` (offsets of ``uih`` and ``candidates`` are
``B + 1`` long), history tokens, candidates ``C`` (``content`` offsets are
``C + 1``), content items, and the two widths. One export serves every batch
shape, empty histories and single candidates included (`exported`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from freescale.jagged.batch import SampleBatch
from freescale.jagged.schema import LEVELS
from freescale.jagged.tensor import JaggedFeatures

WIDTHS = ("uih.width", "candidates.width")
# Widths are at least 2: padding a width of 0 or 1 to 2 adds exact zeros only,
# and a width that could be 1 would make every layout check (is this
# transpose contiguous? does this dimension broadcast?) a guard on it.
MIN_WIDTH = 2


@dataclass(frozen=True)
class Signature:
    """Feature names and dtypes per level, in input order; ``dense_dim`` 0: no dense."""

    uih: tuple[tuple[str, str], ...]
    candidates: tuple[tuple[str, str], ...]
    content: tuple[tuple[str, str], ...]
    dense_dim: int = 0

    @classmethod
    def of(cls, batch: SampleBatch) -> Signature:
        """The signature of batches like ``batch`` (its features, in its order)."""

        def named(level: JaggedFeatures) -> tuple[tuple[str, str], ...]:
            return tuple((name, _dtype_name(t.dtype)) for name, t in level.features.items())

        dense = 0 if batch.dense is None else int(batch.dense.shape[1])
        return cls(named(batch.uih), named(batch.candidates), named(batch.content), dense)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Signature:
        levels = {level: tuple((n, t) for n, t in d[level]) for level in LEVELS}
        return cls(**levels, dense_dim=int(d.get("dense_dim", 0)))

    def as_dict(self) -> dict[str, Any]:
        return {
            **{level: [list(p) for p in getattr(self, level)] for level in LEVELS},
            "dense_dim": self.dense_dim,
        }

    def inputs(self) -> list[tuple[str, str]]:
        """``(input name, dtype)`` of every input of the program, in order."""
        out: list[tuple[str, str]] = []
        for level in LEVELS:
            out.append((f"{level}.offsets", "int64"))
            out += [(f"{level}.{name}", dtype) for name, dtype in getattr(self, level)]
        if self.dense_dim:
            out.append(("dense", "float32"))
        return out + [(w, "int8") for w in WIDTHS]

    def flatten(self, batch: SampleBatch) -> tuple[Tensor, ...]:
        """The program's inputs for ``batch`` (one host read for the widths)."""
        flat: list[Tensor] = []
        for level in LEVELS:
            jagged: JaggedFeatures = getattr(batch, level)
            names = [n for n, _ in getattr(self, level)]
            if sorted(names) != sorted(jagged.features):
                raise ValueError(
                    f"batch {level} features {sorted(jagged.features)} are not the exported "
                    f"model's {sorted(names)}"
                )
            flat.append(jagged.offsets)
            flat += [jagged.features[n] for n in names]
        if self.dense_dim:
            if batch.dense is None:
                raise ValueError(f"the exported model takes dense features [B, {self.dense_dim}]")
            flat.append(batch.dense)
        sizes = program_widths(batch)
        flat += [torch.zeros(w, dtype=torch.int8, device=batch.device) for w in sizes]
        self.check(flat)
        return tuple(flat)

    def check(self, flat: Sequence[Tensor]) -> None:
        """One-line ValueError unless ``flat`` has this signature's count and dtypes."""
        names = self.inputs()
        if len(flat) != len(names):
            raise ValueError(f"the exported model takes {len(names)} tensors, got {len(flat)}")
        for (name, dtype), t in zip(names, flat, strict=True):
            if _dtype_name(t.dtype) != dtype:
                raise ValueError(f"input {name} must be {dtype}, got {_dtype_name(t.dtype)}")

    def unflatten(self, flat: Sequence[Tensor]) -> SampleBatch:
        """The batch a model's ``forward`` reads, from the program's inputs."""
        it: Iterator[Tensor] = iter(flat)
        levels = {}
        for level in LEVELS:
            offsets = next(it)
            levels[level] = JaggedFeatures(offsets, {n: next(it) for n, _ in getattr(self, level)})
        dense = next(it) if self.dense_dim else None
        uih_width, cand_width = next(it), next(it)
        n_cand = levels["content"].offsets.shape[0] - 1
        offsets = levels["uih"].offsets
        return SampleBatch(
            uih=levels["uih"],
            candidates=levels["candidates"],
            labels=torch.zeros(n_cand, device=offsets.device),
            content=levels["content"],
            sample_id=torch.arange(offsets.shape[0] - 1, device=offsets.device),
            dense=dense,
            max_lengths=(uih_width.shape[0], cand_width.shape[0]),
        )

    def dynamic_shapes(self) -> tuple[dict[int, Any], ...]:
        """`torch.export` dynamic dimensions of `inputs`, in order."""
        from torch.export import Dim  # not at import: `import freescale` stays light

        samples, candidates = Dim("samples"), Dim("candidates")
        rows = {"uih": Dim("history_tokens"), "candidates": candidates,
                "content": Dim("content_items")}  # fmt: skip
        segments = {"uih": samples, "candidates": samples, "content": candidates}
        shapes: list[dict[int, Any]] = []
        for level in LEVELS:
            shapes.append({0: segments[level] + 1})
            shapes += [{0: rows[level]} for _ in getattr(self, level)]
        if self.dense_dim:
            shapes.append({0: samples})
        widths = (Dim("history_width", min=MIN_WIDTH), Dim("candidate_width", min=MIN_WIDTH))
        return (*shapes, *({0: w} for w in widths))


def widths(batch: SampleBatch) -> tuple[int, int]:
    """(longest history, most candidates of a sample): ``batch.max_lengths``
    when the batch knows them, else one host read."""
    if batch.max_lengths is not None:
        return batch.max_lengths
    if batch.batch_size == 0:
        return 0, 0
    lengths = torch.stack([batch.uih_lengths().max(), batch.num_candidates().max()])
    uih, cand = lengths.tolist()
    return int(uih), int(cand)


def program_widths(batch: SampleBatch) -> tuple[int, int]:
    """The widths the program pads ``batch`` to: `widths`, at least `MIN_WIDTH`.
    A model given them as ``batch.max_lengths`` runs eagerly what the program runs."""
    uih, cand = widths(batch)
    return max(uih, MIN_WIDTH), max(cand, MIN_WIDTH)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
