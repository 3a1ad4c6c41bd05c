"""HSTU's pointwise jagged attention with a relative position and time bias.

HSTU (Zhai et al. 2024, "Actions Speak Louder than Words") replaces softmax
attention by a pointwise one. For query i and key j of one sample::

    a_ij = SiLU(α·q_i·k_j + rab(p_i - p_j, t_i - t_j)) / N,    out_i = Σ_j a_ij·v_j

with α = 1/sqrt(head dim), N the sample's sequence length as its candidates
see it (its L history events plus the candidate itself: L + 1, so never 0),
and ``rab`` a relative attention bias: one learned scalar per bucket of
relative position plus one per bucket of relative time (`log_buckets`),
shared by the heads, one pair of tables per layer (as HSTU has it). No
softmax: weights do not compete, so the output keeps how *much* of the
history matches, not only which part of it.

Two patterns per layer (the same as the reference model's, `attention.py`):

- history: causal within each sample's history (key j ≤ query i);
- candidates: candidate c of a sample attends to that sample's whole history
  *and to itself*, never to the sample's other candidates, so nothing about
  one candidate (its ids, its label) can reach another's score. Its position
  is L (right after the last event), its time the candidate's own timestamp
  when the data has one (``candidates.timestamps``), else the last event's.

Three implementations behind one interface (`layout(...)` then ``attend``):

- ``reference``: a loop over samples, each an explicit ``[H, L, L]`` matrix —
  the formula above, written out;
- ``padded``: the batch padded to its longest history (``[B, H, L, L]``
  scores, a shared causal mask), a handful of large kernels per layer (plain
  torch): the CPU default. Its work grows with the batch's *longest* history
  (B·L_max²) and so does its memory;
- ``fused``: the Triton kernels of `freescale.kernels.attention.hstu` on the
  packed rows (the bias inside the kernels, memory linear in the tokens,
  Σ L_i² work, blocks above the diagonal skipped): the CUDA default.

They agree to rounding (`tests/models/test_hstu.py`). A candidate's
attention to itself is one elementwise term, computed by the same code in
all three (`_self_term`). ``bias=None`` leaves the relative bias out (the
benchmarks' plain SiLU attention).

Buckets are exact integer functions (`kernels.attention.hstu.log_buckets`):
the float log2 they used to go through put a few values next to a power of
two (2^24 - 1 s, ...) one bucket too far.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from freescale.jagged.ops import segment_ids
from freescale.kernels.attention.hstu import (
    POSITION,
    TIME,
    Schedule,
    log_buckets,
    opaque_hstu_attention,
)
from freescale.kernels.backend import triton_available
from freescale.models.small_embedding import SmallEmbedding

IMPLS = ("auto", "reference", "padded", "fused")


def position_buckets(rel: Tensor) -> Tensor:
    """Relative position buckets: 0..7 exactly, then 2 per doubling (`kernels.attention.hstu`)."""
    return log_buckets(rel, POSITION)


def time_buckets(dt: Tensor) -> Tensor:
    """Relative time buckets: 0, then one per doubling of the timestamps' unit."""
    return log_buckets(dt, TIME)


class RelativeBias(nn.Module):
    """``rab``: a scalar per relative-position bucket plus one per relative-time
    bucket. Tables of 32 rows: `SmallEmbedding` (on CUDA a two-kernel,
    reproducible weight gradient over the ``B·L²`` lookups)."""

    def __init__(self) -> None:
        super().__init__()
        self.position = SmallEmbedding(POSITION.count, 1)
        self.time = SmallEmbedding(TIME.count, 1)
        nn.init.zeros_(self.position.weight)  # start as plain SiLU attention
        nn.init.zeros_(self.time.weight)

    def forward(self, position_ids: Tensor, time_ids: Tensor) -> Tensor:
        """Bias of each pair (the two id tensors broadcast against each other)."""
        return self.position(position_ids).squeeze(-1) + self.time(time_ids).squeeze(-1)

    def tables(self) -> tuple[Tensor, Tensor]:
        """The two tables as flat views (what the fused kernels read)."""
        return self.position.weight.view(-1), self.time.weight.view(-1)


def resolve_impl(impl: str, on_cuda: bool = False) -> str:
    """``auto`` -> ``fused`` on CUDA where Triton imports, else ``padded`` (on the
    CPU the faster of the two torch paths: a few large kernels instead of a loop);
    ``reference`` is for checking them."""
    if impl not in IMPLS:
        raise ValueError(f"hstu attention must be auto, reference, padded or fused, got {impl!r}")
    if impl == "auto":
        return "fused" if on_cuda and triton_available() else "padded"
    return impl


@dataclass(frozen=True)
class Common:
    """What both implementations read: 1/N per token (N = its sample's L + 1)."""

    inv_len_uih: Tensor  # [Tu, 1, 1] 1/(L+1) of each history event's sample
    inv_len_cand: Tensor  # [Tc, 1, 1] the same for each candidate


def _common(uih_offsets: Tensor, cand_offsets: Tensor, n_u: int, n_c: int) -> Common:
    inv = 1.0 / (uih_offsets.diff() + 1).to(torch.float32)
    return Common(
        inv[segment_ids(uih_offsets, n_u)].view(-1, 1, 1),
        inv[segment_ids(cand_offsets, n_c)].view(-1, 1, 1),
    )


def candidate_times(
    uih_offsets: Tensor, uih_times: Tensor, cand_offsets: Tensor, num_candidates: int
) -> Tensor:
    """Each candidate's time when the data gives none: its sample's last
    event's (0 for an empty history, which leaves no key to compare with)."""
    # Behind a leading 0, a sample's last event sits at its end offset: one
    # gather for every batch, no branch on an empty history (`torch.export`
    # traces one program for all of them).
    times = torch.cat([uih_times.new_zeros(1), uih_times])
    last = torch.where(uih_offsets.diff() > 0, times[uih_offsets[1:]], 0)
    return last[segment_ids(cand_offsets, num_candidates)]


def _self_term(
    bias: RelativeBias | None, q_c: Tensor, k_c: Tensor, v_c: Tensor, inv_len_cand: Tensor
) -> Tensor:
    """Each candidate's attention to itself (relative position and time 0)."""
    score = (q_c * q_c.shape[-1] ** -0.5 * k_c).sum(-1, keepdim=True)
    if bias is not None:
        zero = torch.zeros(1, dtype=torch.int32, device=q_c.device)
        score = score + bias(zero, zero)
    return F.silu(score) * inv_len_cand * v_c


def _rab(bias: RelativeBias | None, pos: Tensor, dt: Tensor) -> Tensor | float:
    return 0.0 if bias is None else bias(pos, dt)


@dataclass(frozen=True)
class ReferenceLayout:
    """Per sample: host bounds and its bucket ids (shared by every layer)."""

    common: Common
    uih_bounds: list[int]
    cand_bounds: list[int]
    # per sample: (history position ids [L, L], time ids [L, L],
    #              candidate position ids [L], time ids [C, L], causal mask [L, L])
    ids: list[tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]

    def attend(
        self,
        bias: RelativeBias | None,
        qkv_u: tuple[Tensor, Tensor, Tensor],
        qkv_c: tuple[Tensor, Tensor, Tensor],
        uih_out: bool = True,
    ) -> tuple[Tensor | None, Tensor]:
        """(history outputs [Tu, H, d], None when not ``uih_out``; candidate outputs [Tc, H, d])."""
        (q_u, k_u, v_u), (q_c, k_c, v_c) = qkv_u, qkv_c
        alpha = q_u.shape[-1] ** -0.5
        hb, cb = self.uih_bounds, self.cand_bounds
        outs_u, outs_c = [q_u[:0]], [q_c[:0]]
        for i, (pos, dt, pos_c, dt_c, causal) in enumerate(self.ids):
            h0, h1, c0, c1 = hb[i], hb[i + 1], cb[i], cb[i + 1]
            inv_n = 1.0 / (h1 - h0 + 1)
            q, k, v = q_u[h0:h1], k_u[h0:h1], v_u[h0:h1]
            if uih_out:
                s = torch.einsum("qhd,khd->hqk", q * alpha, k) + _rab(bias, pos, dt)
                a = F.silu(s) * causal * inv_n
                outs_u.append(torch.einsum("hqk,khd->qhd", a, v))
            s_c = torch.einsum("chd,khd->hck", q_c[c0:c1] * alpha, k) + _rab(bias, pos_c, dt_c)
            outs_c.append(torch.einsum("hck,khd->chd", F.silu(s_c) * inv_n, v))
        out_c = torch.cat(outs_c) + _self_term(bias, q_c, k_c, v_c, self.common.inv_len_cand)
        return (torch.cat(outs_u) if uih_out else None), out_c


def reference_layout(
    uih_offsets: Tensor, cand_offsets: Tensor, uih_times: Tensor, cand_times: Tensor
) -> ReferenceLayout:
    """Bucket ids of every sample's pairs, once per forward (every layer shares them)."""
    hb, cb = uih_offsets.tolist(), cand_offsets.tolist()
    ids = []
    for i in range(len(hb) - 1):
        h0, h1, c0, c1 = hb[i], hb[i + 1], cb[i], cb[i + 1]
        t, t_c = uih_times[h0:h1], cand_times[c0:c1]
        pos = torch.arange(h1 - h0, device=uih_offsets.device)
        ids.append(
            (
                position_buckets(pos[:, None] - pos[None, :]),
                time_buckets(t[:, None] - t[None, :]),
                position_buckets(h1 - h0 - pos),
                time_buckets(t_c[:, None] - t[None, :]),
                pos[:, None] >= pos[None, :],
            )
        )
    common = _common(uih_offsets, cand_offsets, hb[-1], cb[-1])
    return ReferenceLayout(common, hb, cb, ids)


@dataclass(frozen=True)
class PaddedLayout:
    """The batch padded to [B, L_max] history / [B, C_max] candidate slots."""

    common: Common
    batch: int
    max_uih: int
    max_cand: int
    uih_slot: Tensor  # [Tu] flat padded slot (sample·L_max + position) of each event
    cand_slot: Tensor  # [Tc] the same for candidates (sample·C_max + index)
    causal: Tensor  # [L, L] bool, key position ≤ query position
    pos_ids: Tensor  # [L, L] history relative position buckets (same for every sample)
    time_ids: Tensor  # [B, L, L] history relative time buckets
    key_valid: Tensor  # [B, 1, 1, L] bool, key position < the sample's length
    cand_pos_ids: Tensor  # [B, 1, L] candidate-to-history position buckets
    cand_time_ids: Tensor  # [B, C, L] candidate-to-history time buckets

    def _pad(self, x: Tensor, slot: Tensor, width: int) -> Tensor:
        """[T, H, d] -> [B, H, width, d], zeros in the empty slots."""
        flat = x.new_zeros(self.batch * width, *x.shape[1:]).index_copy(0, slot, x)
        return flat.view(self.batch, width, *x.shape[1:]).transpose(1, 2)

    def _unpad(self, x: Tensor, slot: Tensor) -> Tensor:
        """[B, H, width, d] -> [T, H, d] (the filled slots only)."""
        return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[-1]).index_select(0, slot)

    def attend(
        self,
        bias: RelativeBias | None,
        qkv_u: tuple[Tensor, Tensor, Tensor],
        qkv_c: tuple[Tensor, Tensor, Tensor],
        uih_out: bool = True,
    ) -> tuple[Tensor | None, Tensor]:
        """Same contract as `ReferenceLayout.attend`."""
        (q_u, k_u, v_u), (q_c, k_c, v_c) = qkv_u, qkv_c
        alpha = q_u.shape[-1] ** -0.5
        k = self._pad(k_u, self.uih_slot, self.max_uih)
        v = self._pad(v_u, self.uih_slot, self.max_uih)
        out_u = None
        if uih_out:
            q = self._pad(q_u, self.uih_slot, self.max_uih)
            rab = _rab(bias, self.pos_ids, self.time_ids)
            s = (q * alpha) @ k.transpose(-1, -2) + (rab[:, None] if bias is not None else 0.0)
            # Padded queries are never read back; padded keys lie above the diagonal
            # of every real query, so the causal mask alone covers them.
            a = F.silu(s) * self.causal
            out_u = self._unpad(a @ v, self.uih_slot) * self.common.inv_len_uih
        q = self._pad(q_c, self.cand_slot, self.max_cand)
        rab = _rab(bias, self.cand_pos_ids, self.cand_time_ids)
        rab = rab[:, None] if bias is not None else 0.0
        a = F.silu((q * alpha) @ k.transpose(-1, -2) + rab) * self.key_valid
        out_c = self._unpad(a @ v, self.cand_slot) * self.common.inv_len_cand
        return out_u, out_c + _self_term(bias, q_c, k_c, v_c, self.common.inv_len_cand)


def padded_layout(
    uih_offsets: Tensor,
    cand_offsets: Tensor,
    uih_times: Tensor,
    cand_times: Tensor,
    max_uih: int | None = None,
    max_cand: int | None = None,
) -> PaddedLayout:
    """Slots, masks and bucket ids of the padded batch, once per forward.
    Maxima not given are read back (one host read)."""
    b = uih_offsets.numel() - 1
    uih_len, cand_len = uih_offsets.diff(), cand_offsets.diff()
    if max_uih is None or max_cand is None:
        max_uih, max_cand = torch.stack([uih_len.max(), cand_len.max()]).tolist() if b else (0, 0)
    n_u, n_c = uih_times.numel(), cand_times.numel()
    dev = uih_offsets.device

    def slots(offsets: Tensor, total: int, width: int) -> Tensor:
        """sample·width + position within the sample, of each value."""
        seg = segment_ids(offsets, total)
        return seg * width + torch.arange(total, device=dev) - offsets[seg]

    uih_slot = slots(uih_offsets, n_u, max_uih)
    cand_slot = slots(cand_offsets, n_c, max_cand)
    t = uih_times.new_zeros(b * max_uih).index_copy(0, uih_slot, uih_times).view(b, max_uih)
    t_c = cand_times.new_zeros(b * max_cand).index_copy(0, cand_slot, cand_times)
    t_c = t_c.view(b, max_cand)
    pos = torch.arange(max_uih, device=dev)
    return PaddedLayout(
        common=_common(uih_offsets, cand_offsets, n_u, n_c),
        batch=b,
        max_uih=max_uih,
        max_cand=max_cand,
        uih_slot=uih_slot,
        cand_slot=cand_slot,
        causal=pos[:, None] >= pos[None, :],
        pos_ids=position_buckets(pos[:, None] - pos[None, :]),
        time_ids=time_buckets(t[:, :, None] - t[:, None, :]),
        key_valid=(pos[None, :] < uih_len[:, None])[:, None, None, :],
        cand_pos_ids=position_buckets(uih_len[:, None] - pos[None, :])[:, None, :],
        cand_time_ids=time_buckets(t_c[:, :, None] - t[:, None, :]),
    )


@dataclass(frozen=True)
class FusedLayout:
    """The packed rows as the fused Triton kernels read them (`kernels.attention.hstu`)."""

    schedule: Schedule
    uih_times: Tensor  # int64 [Tu]
    cand_times: Tensor  # int64 [Tc]
    inv_len_cand: Tensor  # [Tc, 1, 1] 1/(L+1) of each candidate's sample
    op: Callable[..., tuple[Tensor | None, Tensor]]  # the kernels, opaque to dynamo

    def attend(
        self,
        bias: RelativeBias | None,
        qkv_u: tuple[Tensor, Tensor, Tensor],
        qkv_c: tuple[Tensor, Tensor, Tensor],
        uih_out: bool = True,
    ) -> tuple[Tensor | None, Tensor]:
        """Same contract as `ReferenceLayout.attend`."""
        (q_u, k_u, v_u), (q_c, k_c, v_c) = qkv_u, qkv_c
        extra = (self.uih_times, self.cand_times, *bias.tables()) if bias is not None else ()
        out_u, out_c = self.op(q_u, k_u, v_u, q_c, self.schedule, *extra, uih_out=uih_out)
        return out_u, out_c + _self_term(bias, q_c, k_c, v_c, self.inv_len_cand)


def fused_layout(
    uih_offsets: Tensor, cand_offsets: Tensor, uih_times: Tensor, cand_times: Tensor
) -> FusedLayout:
    """The kernels' schedule of the batch, once per forward (no host read)."""
    n_u, n_c = uih_times.numel(), cand_times.numel()
    inv = 1.0 / (uih_offsets.diff() + 1).to(torch.float32)
    return FusedLayout(
        schedule=Schedule(uih_offsets, cand_offsets, n_u, n_c),
        uih_times=uih_times,
        cand_times=cand_times,
        inv_len_cand=inv[segment_ids(cand_offsets, n_c)].view(-1, 1, 1),
        op=opaque_hstu_attention(),
    )


def layout(
    impl: str,
    uih_offsets: Tensor,
    cand_offsets: Tensor,
    uih_times: Tensor,
    cand_times: Tensor | None,
    num_candidates: int,
    max_lengths: tuple[int, int] | None = None,
) -> ReferenceLayout | PaddedLayout | FusedLayout:
    """The layout of ``impl`` (resolved) for one forward; ``cand_times`` None:
    each candidate at its sample's last event (`candidate_times`)."""
    if cand_times is None:
        cand_times = candidate_times(uih_offsets, uih_times, cand_offsets, num_candidates)
    if impl == "reference":
        return reference_layout(uih_offsets, cand_offsets, uih_times, cand_times)
    if impl == "fused":
        return fused_layout(uih_offsets, cand_offsets, uih_times, cand_times)
    max_uih, max_cand = max_lengths or (None, None)
    return padded_layout(uih_offsets, cand_offsets, uih_times, cand_times, max_uih, max_cand)
