"""Dropout whose masks depend on what is dropped, not on the order of draws.

The modes, world sizes, the load balancer and a resumed run all compute a
sample on some rank, in some order; a mask drawn from the global generator
would then differ between them, and so would every number after it. Here
each element's keep bit is a hash of (run seed, step, global sample id,
the token's position in its sample, history or candidate, the dropout site,
the feature column): the same sample gets the same mask wherever and
whenever it is computed, so those runs stay bit-identical with dropout on.

The hash is a few integer rounds (xor-shift, multiply by an odd constant,
keep 32 bits) on int64 tensors: values stay below 2^63, so no step overflows,
and the CPU and the GPU compute the same bits. An element is kept when its
hash is at least ``round(p * 2^32)``, then scaled by ``1 / (1 - p)``.

Dropout runs only inside `SampleDropout.step` (the trainer's training steps)
and in training mode: evaluation, export and a plain model never drop.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import Tensor

from freescale.jagged.batch import UIH_IDS, SampleBatch
from freescale.jagged.ops import segment_ids

_LOW32 = 0xFFFFFFFF
_ROUNDS = (0x7FEB352D, 0x2C1B3C6D)  # odd, < 2^31: x * c < 2^63 for x < 2^32
SITES = ("emb", "attn", "ffn")


def mix32(x: Tensor) -> Tensor:
    """A 32-bit hash of each int64 value (its low 32 bits), as int64 in [0, 2^32)."""
    x = x & _LOW32
    for c in _ROUNDS:
        x = ((x ^ (x >> 16)) * c) & _LOW32
    return x ^ (x >> 16)


def _fold(key: Tensor, value: Tensor | int) -> Tensor:
    return mix32(key ^ value)


def row_keys(
    seed: int, step: int, sample_id: Tensor, offsets: Tensor, total: int, kind: int
) -> Tensor:
    """One key per row of a jagged part of ``total`` rows (history: ``kind`` 0,
    candidates: 1): (seed, step, the row's sample id, its position in the
    sample, kind) hashed."""
    owner = segment_ids(offsets, total)
    position = torch.arange(total, device=offsets.device) - offsets[owner]
    sid = sample_id[owner]
    key = mix32(torch.full_like(sid, seed & _LOW32) ^ (seed >> 32))
    for value in (step, kind):
        key = _fold(key, value)
    for part in (sid & _LOW32, sid >> 32, position):
        key = _fold(key, part)
    return key


def keep_mask(keys: Tensor, site: int, dim: int, p: float) -> Tensor:
    """[rows, dim] bools: the elements of rows ``keys`` kept at dropout ``site``."""
    columns = torch.arange(dim, device=keys.device)
    h = mix32(_fold(keys, site).unsqueeze(1) ^ columns)
    return h >= round(p * 2**32)


class RowDropout:
    """One forward's dropout: the row keys of the batch's history and candidates."""

    def __init__(self, rates: dict[str, float], uih: Tensor, cand: Tensor) -> None:
        self.rates, self.keys = rates, {"uih": uih, "cand": cand}

    def __call__(self, x: Tensor, rows: str, site: str, layer: int = 0) -> Tensor:
        """``x`` (the ``rows`` part's [rows, dim]) with dropout ``site`` of ``layer``."""
        p = self.rates[site]
        if not p:
            return x
        code = layer * len(SITES) + SITES.index(site)
        keep = keep_mask(self.keys[rows], code, x.shape[-1], p)
        return x * (keep.to(x.dtype) * (1.0 / (1.0 - p)))


class SampleDropout:
    """A model's dropout rates (``emb``, ``attn``, ``ffn``) and the step it is in."""

    def __init__(self, emb: float = 0.0, attn: float = 0.0, ffn: float = 0.0) -> None:
        self.rates = {"emb": emb, "attn": attn, "ffn": ffn}
        for site, p in self.rates.items():
            check_rate(f"{site}_dropout", p)
        self._step: tuple[int, int] | None = None

    @property
    def enabled(self) -> bool:
        return any(self.rates.values())

    @contextmanager
    def step(self, seed: int, step: int) -> Iterator[None]:
        """Forwards inside are training step ``step`` of a run seeded ``seed``."""
        self._step = (seed, step)
        try:
            yield
        finally:
            self._step = None

    def for_batch(self, batch: SampleBatch, training: bool) -> RowDropout | None:
        """This forward's dropout; None outside a training step (no dropout)."""
        if not (training and self.enabled and self._step is not None):
            return None
        seed, step = self._step
        n_u, n_c = batch.uih[UIH_IDS].numel(), batch.num_candidates_total
        uih = row_keys(seed, step, batch.sample_id, batch.uih.offsets, n_u, 0)
        cand = row_keys(seed, step, batch.sample_id, batch.candidates.offsets, n_c, 1)
        return RowDropout(self.rates, uih, cand)


def check_rate(name: str, p: object) -> None:
    """A one-line ValueError unless ``p`` is a number in [0, 1)."""
    ok = isinstance(p, (int, float)) and not isinstance(p, bool)
    if not (ok and math.isfinite(p) and 0 <= p < 1):  # type: ignore[arg-type]
        raise ValueError(f"model.{name} must be a number in [0, 1), got {p!r}")


def training_step(model: object, seed: int, step: int) -> AbstractContextManager[None]:
    """The context in which ``model``'s forward is training step ``step``
    (nothing for a model without `SampleDropout`)."""
    dropout = getattr(model, "sample_dropout", None)
    if isinstance(dropout, SampleDropout):
        return dropout.step(seed, step)
    return nullcontext()
