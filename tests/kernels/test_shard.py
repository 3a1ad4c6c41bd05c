"""The one row-sharding (`freescale.kernels.shard`): the stripe hash, the
assignment's invariants, and its eager/Triton twins against the reference.
(That the assignment never changes is pinned in `test_sharding_pinned`.)"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.embedding import RowSharding as EmbeddingSharding
from freescale.kernels import RowSharding, bucketize_by_shard
from freescale.kernels.shard import bucketize_eager, bucketize_reference, stripe_hash

from .strategies import ID_DTYPES, ids_tensor, same

shardings = st.builds(
    RowSharding,
    rows=st.integers(1, 300),
    world_size=st.integers(1, 12),
    kind=st.sampled_from(["block", "hashed"]),
    block_size=st.sampled_from([1, 1, 2, 5]),
)


def stripe_hash_python(g: int) -> int:
    """The hash of the `shard` docstring, on Python ints."""
    m = 0x7FFFFFFF
    x = g & m
    x = (x * 0x45D9F3B) & m
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & m
    return x ^ (x >> 16)


def test_stripe_hash_matches_its_definition():
    gs = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40 + 7, 2**62]
    assert stripe_hash(torch.tensor(gs)).tolist() == [stripe_hash_python(g) for g in gs]


def test_embedding_uses_the_same_class():
    assert EmbeddingSharding is RowSharding


@settings(max_examples=80, deadline=None)
@given(sharding=shardings)
def test_assignment_is_a_balanced_bijection(sharding):
    w, per = sharding.world_size, sharding.local_rows
    all_ids = torch.arange(sharding.rows)
    owner, local = bucketize_reference(all_ids, sharding)
    assert int(owner.min()) >= 0 and int(owner.max()) < w
    assert int(local.min()) >= 0 and int(local.max()) < per
    assert torch.unique(owner * per + local).numel() == sharding.rows  # no shared slot
    seen = torch.zeros(sharding.rows, dtype=torch.int64)
    for rank in range(w):
        held = sharding.global_ids(rank)
        assert held.numel() == per
        rows = held[held >= 0]
        assert same(held[rows.numel() :], torch.full_like(held[rows.numel() :], -1))  # suffix
        o, loc = bucketize_reference(rows, sharding)
        assert same(o, torch.full_like(rows, rank))
        assert same(loc, torch.arange(rows.numel()))  # slot i holds global_ids[i]
        seen[rows] += 1
    assert same(seen, torch.ones_like(seen))  # a partition of the table
    if sharding.kind == "hashed":
        counts = torch.bincount(owner, minlength=w)
        assert int(counts.max() - counts.min()) <= 2 * sharding.block_size


def test_block_owns_contiguous_ranges():
    sharding = RowSharding(10, 4, "block")
    assert sharding.local_rows == 3
    assert [sharding.global_ids(r).tolist() for r in range(4)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [9, -1, -1],
    ]


def test_hashed_spreads_hot_consecutive_and_strided_ids():
    world = 16
    for bs in (1, 4):
        sharding = RowSharding(1_000_000, world, "hashed", bs)
        for start in (0, 16 * 1000 * bs, 16 * 54321 * bs):
            owner, _ = bucketize_reference(torch.arange(start, start + world * bs), sharding)
            assert torch.bincount(owner, minlength=world).tolist() == [bs] * world
        strided = torch.arange(0, world * bs * 4096, world * bs)  # one id per stripe, same column
        owner, _ = bucketize_reference(strided, sharding)
        counts = torch.bincount(owner, minlength=world)
        assert int(counts.max()) < 2 * 4096 // world  # near-uniform, not all on one rank
    block_owner, _ = bucketize_reference(
        torch.arange(0, 100), RowSharding(1_000_000, world, "block")
    )
    assert block_owner.unique().tolist() == [0]  # what hashing is for


def test_locate_gives_invalid_ids_a_valid_owner():
    for kind in ("hashed", "block"):
        owner, _ = RowSharding(10, 3, kind).locate(torch.tensor([-5, -1, 10, 2**40]))
        assert bool(((owner >= 0) & (owner < 3)).all())


@settings(max_examples=60, deadline=None)
@given(sharding=shardings, n=st.integers(0, 50), seed=st.integers(0, 2**16))
def test_eager_equals_reference(sharding, n, seed):
    for dtype in ID_DTYPES:
        ids = ids_tensor(n, seed, dtype, sharding.rows)
        want = bucketize_reference(ids, sharding)
        assert want[0].dtype == torch.int64 and want[1].dtype == dtype
        got = bucketize_eager(ids, sharding)
        assert same(got[0], want[0]) and same(got[1], want[1])


@settings(max_examples=40, deadline=None)
@given(
    sharding=shardings,
    n=st.integers(0, 50),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(ID_DTYPES),
)
def test_triton_equals_reference(triton_device, sharding, n, seed, dtype):
    ids = ids_tensor(n, seed, dtype, sharding.rows)
    want = bucketize_reference(ids, sharding)
    got = bucketize_by_shard(ids.to(triton_device), sharding, impl="triton")
    assert same(got[0], want[0]) and same(got[1], want[1])


LARGE = [(2**40, 1024, "hashed", 1), (2**40, 512, "hashed", 2), (2**40, 512, "block", 1)]


def test_large_ids_int64():
    """Ids beyond 2**32 (the hash uses the low 31 bits of the stripe) at the table bounds."""
    sharding = RowSharding(2**40, 1024, "hashed")
    ids = torch.tensor([0, 2**40 - 1, 2**33 + 5])
    owner, local = bucketize_reference(ids, sharding)
    assert local.tolist() == [0, (2**40 - 1) // 1024, (2**33 + 5) // 1024]
    for rank, loc, gid in zip(owner.tolist(), local.tolist(), ids.tolist(), strict=True):
        assert (gid % 1024 + stripe_hash_python(loc)) % 1024 == rank


def test_triton_large_ids(triton_device):
    for rows, w, kind, bs in LARGE:
        sharding = RowSharding(rows, w, kind, bs)
        ids = torch.tensor([0, rows - 1, 2**33 + 5, 2**32 - 1, 2**32])
        want = bucketize_reference(ids, sharding)
        got = bucketize_by_shard(ids.to(triton_device), sharding, impl="triton")
        assert same(got[0], want[0]) and same(got[1], want[1]), (kind, bs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rows": 0, "world_size": 1}, "rows"),
        ({"rows": 5, "world_size": 0}, "world_size"),
        ({"rows": 5, "world_size": 1, "kind": "random"}, "kind"),
        ({"rows": 5, "world_size": 1, "block_size": 0}, "block_size"),
        ({"rows": 2**40, "world_size": 2}, "stripes"),
    ],
)
def test_invalid_configs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RowSharding(**kwargs)


def test_invalid_calls():
    with pytest.raises(ValueError, match="rank"):
        RowSharding(10, 2).global_ids(2)
    with pytest.raises(ValueError, match="integer"):
        bucketize_by_shard(torch.zeros(3), RowSharding(10, 2))


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(["block", "hashed"]),
    block_size=st.sampled_from([1, 2, 5]),
    rows=st.integers(1, 300),
    ids=st.lists(st.integers(-(2**40), 2**40), max_size=50),
)
def test_one_rank_shortcut_is_what_the_formulas_give(kind, block_size, rows, ids):
    sharding = RowSharding(rows, 1, kind, block_size)
    x = torch.tensor(ids + list(range(rows)), dtype=torch.int64)
    owner, local = sharding.locate(x)
    ref_owner, ref_local = sharding.locate_by_formula(x)
    assert same(owner, ref_owner) and same(local, ref_local)
