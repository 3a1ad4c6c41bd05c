"""The one row-sharding gives every id the owner and local row it had before the
two implementations (``embedding.sharding`` and ``kernels.shard``) were merged.

The functions prefixed ``pinned_`` are frozen copies of those two pre-merge
implementations (commit 181c081); checkpoints and parity tests rely on the
assignment never changing, so they must not be edited to follow the code.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.embedding import RowSharding as EmbeddingSharding
from freescale.kernels import RowSharding, bucketize_by_shard

_M31 = 0x7FFFFFFF
_MUL = 0x45D9F3B


def pinned_hash(g: torch.Tensor) -> torch.Tensor:
    x = g.to(torch.int64) & _M31
    x = (x * _MUL) & _M31
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M31
    return x ^ (x >> 16)


# ---- pre-merge embedding.sharding.RowSharding ----------------------------------
def pinned_local_rows(rows: int, w: int, kind: str, bs: int) -> int:
    if kind == "block":
        return -(-rows // w)
    return -(-rows // (bs * w)) * bs


def pinned_locate(rows, w, kind, bs, ids):
    ids = ids.to(torch.int64)
    if kind == "block":
        per = pinned_local_rows(rows, w, kind, bs)
        owner = torch.div(ids, per, rounding_mode="floor").clamp_(0, w - 1)
        return owner, ids - owner * per
    span = bs * w
    stripe = torch.div(ids, span, rounding_mode="floor")
    within = ids - stripe * span
    block = torch.div(within, bs, rounding_mode="floor")
    owner = (block + pinned_hash(stripe)) % w
    return owner, stripe * bs + (within - block * bs)


def pinned_global_ids(rows, w, kind, bs, rank):
    per = pinned_local_rows(rows, w, kind, bs)
    slot = torch.arange(per, dtype=torch.int64)
    if kind == "block":
        ids = rank * per + slot
    else:
        stripe = torch.div(slot, bs, rounding_mode="floor")
        block = (rank - pinned_hash(stripe)) % w
        ids = stripe * bs * w + block * bs + (slot - stripe * bs)
    return torch.where(ids < rows, ids, torch.full_like(ids, -1))


# ---- pre-merge kernels.shard (block_size 1 only) --------------------------------
def pinned_bucketize(rows, w, kind, ids):
    x = ids.to(torch.int64)
    r = max(1, -(-rows // w))
    if kind == "block":
        owner = x // r
        local = x - owner * r
    else:
        local = x // w
        owner = (x % w + pinned_hash(local)) % w
    return owner, local.to(ids.dtype)


def pinned_global_rows(rows, w, kind, rank):
    r = -(-rows // w)
    if kind == "block":
        lo = min(rank * r, rows)
        return torch.arange(lo, min(lo + r, rows), dtype=torch.int64)
    stripes = torch.arange(r, dtype=torch.int64)
    ids = stripes * w + (rank - pinned_hash(stripes)) % w
    return ids[ids < rows]


# ---- the comparisons -------------------------------------------------------------
configs = st.tuples(
    st.one_of(st.integers(1, 300), st.integers(1, 10**9)),  # rows: tiny and large tables
    st.integers(1, 12),  # world size, one rank included
    st.sampled_from(["block", "hashed"]),
    st.integers(1, 6),  # block size
)


def random_ids(rows: int, n: int, seed: int, dtype=torch.int64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (n,), generator=g)
    ids[: min(n, 2)] = torch.tensor([rows - 1, 0])[: min(n, 2)]  # the table bounds
    return ids.to(dtype)


@settings(max_examples=120, deadline=None)
@given(cfg=configs, n=st.integers(0, 64), seed=st.integers(0, 2**16))
def test_embedding_assignment_unchanged(cfg, n, seed):
    rows, w, kind, bs = cfg
    s = EmbeddingSharding(rows, w, kind, bs)
    assert s.local_rows == pinned_local_rows(rows, w, kind, bs)
    ids = random_ids(rows, n, seed)
    # invalid ids too: the embedding gives them an owner in [0, W) (lookups mask them)
    ids = torch.cat([ids, torch.tensor([-7, -1, rows, rows + 13, 2**40])])
    for got, want in zip(s.locate(ids), pinned_locate(rows, w, kind, bs, ids), strict=True):
        assert got.dtype == torch.int64 and torch.equal(got, want)
    if s.local_rows <= 10_000:
        for rank in range(w):
            assert torch.equal(s.global_ids(rank), pinned_global_ids(rows, w, kind, bs, rank))


@settings(max_examples=120, deadline=None)
@given(cfg=configs, n=st.integers(0, 64), seed=st.integers(0, 2**16), wide=st.booleans())
def test_kernel_bucketize_unchanged(cfg, n, seed, wide):
    rows, w, kind, _ = cfg
    dtype = torch.int64 if wide or rows >= 2**31 else torch.int32
    ids = random_ids(rows, n, seed, dtype)
    got = bucketize_by_shard(ids, RowSharding(rows, w, kind), impl="torch")
    want = pinned_bucketize(rows, w, kind, ids)
    assert got[0].dtype == torch.int64 and got[1].dtype == dtype
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 300), w=st.integers(1, 12), kind=st.sampled_from(["block", "hashed"]))
def test_kernel_row_lists_unchanged(rows, w, kind):
    s = RowSharding(rows, w, kind)
    for rank in range(w):
        held = s.global_ids(rank)
        assert torch.equal(held[held >= 0], pinned_global_rows(rows, w, kind, rank))


def test_both_packages_share_one_assignment():
    """What the merge is for: the kernels route an id where the embedding stores it."""
    for rows, w, kind, bs in [(1000, 7, "hashed", 1), (1001, 4, "block", 1), (97, 3, "hashed", 1)]:
        ids = torch.arange(rows)
        emb = EmbeddingSharding(rows, w, kind, bs).locate(ids)
        ker = bucketize_by_shard(ids, RowSharding(rows, w, kind), impl="torch")
        assert torch.equal(emb[0], ker[0]) and torch.equal(emb[1], ker[1])
