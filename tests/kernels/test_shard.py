import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.kernels import RowSharding, bucketize_by_shard
from freescale.kernels.shard import bucketize_eager, bucketize_reference, stripe_hash

from .strategies import ID_DTYPES, ids_tensor, same

shardings = st.builds(
    RowSharding,
    num_rows=st.integers(1, 300),
    world_size=st.integers(1, 12),
    scheme=st.sampled_from(["block", "hashed"]),
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


@settings(max_examples=80, deadline=None)
@given(sharding=shardings)
def test_every_row_has_one_owner_and_a_unique_local_row(sharding):
    all_ids = torch.arange(sharding.num_rows)
    owner, local = bucketize_reference(all_ids, sharding)
    assert int(owner.min()) >= 0 and int(owner.max()) < sharding.world_size
    assert int(local.min()) >= 0 and int(local.max()) < sharding.rows_per_rank
    seen = torch.zeros(sharding.num_rows, dtype=torch.int64)
    for rank in range(sharding.world_size):
        rows = sharding.global_rows(rank)
        assert rows.numel() <= sharding.rows_per_rank
        o, loc = bucketize_reference(rows, sharding)
        assert same(o, torch.full_like(rows, rank))
        assert same(loc, torch.arange(rows.numel()))  # local row i holds global_rows[i]
        seen[rows] += 1
    assert same(seen, torch.ones_like(seen))  # a partition of the table


def test_block_owns_contiguous_ranges():
    sharding = RowSharding(10, 4, "block")
    assert sharding.rows_per_rank == 3
    assert [sharding.global_rows(r).tolist() for r in range(4)] == [
        [0, 1, 2],
        [3, 4, 5],
        [6, 7, 8],
        [9],
    ]


def test_hashed_spreads_hot_consecutive_and_strided_ids():
    world = 16
    sharding = RowSharding(1_000_000, world, "hashed")
    for start in (0, 16 * 1000, 16 * 54321):
        owner, _ = bucketize_reference(torch.arange(start, start + world), sharding)
        assert sorted(owner.tolist()) == list(range(world))  # one per rank
    strided = torch.arange(0, world * 4096, world)  # all ids with id % W == 0
    owner, _ = bucketize_reference(strided, sharding)
    counts = torch.bincount(owner, minlength=world)
    assert int(counts.max()) < 2 * 4096 // world  # near-uniform, not all on one rank
    block_owner, _ = bucketize_reference(torch.arange(0, 100), RowSharding(1_000_000, world))
    assert block_owner.unique().tolist() == [0]  # what hashing is for


@settings(max_examples=60, deadline=None)
@given(sharding=shardings, n=st.integers(0, 50), seed=st.integers(0, 2**16))
def test_eager_equals_reference(sharding, n, seed):
    for dtype in ID_DTYPES:
        ids = ids_tensor(n, seed, dtype, sharding.num_rows)
        want = bucketize_reference(ids, sharding)
        assert want[1].dtype == dtype
        got = bucketize_eager(ids, sharding)
        assert same(got[0], want[0]) and same(got[1], want[1])


@settings(max_examples=30, deadline=None)
@given(
    sharding=shardings,
    n=st.integers(0, 50),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from(ID_DTYPES),
)
def test_triton_equals_reference(triton_device, sharding, n, seed, dtype):
    ids = ids_tensor(n, seed, dtype, sharding.num_rows)
    want = bucketize_reference(ids, sharding)
    got = bucketize_by_shard(ids.to(triton_device), sharding, impl="triton")
    assert same(got[0], want[0]) and same(got[1], want[1])


def test_large_ids_int64():
    """Ids beyond 2**32 (hash uses the low 32 bits of the stripe) at the table bounds."""
    sharding = RowSharding(2**40, 512, "hashed")
    ids = torch.tensor([0, 2**40 - 1, 2**33 + 5])
    owner, local = bucketize_reference(ids, sharding)
    assert local.tolist() == [0, (2**40 - 1) // 512, (2**33 + 5) // 512]
    for rank, loc, gid in zip(owner.tolist(), local.tolist(), ids.tolist(), strict=True):
        assert (gid % 512 + stripe_hash_python(loc)) % 512 == rank


def test_sharding_validation():
    with pytest.raises(ValueError, match="world_size"):
        RowSharding(10, 0)
    with pytest.raises(ValueError, match="num_rows"):
        RowSharding(-1, 2)
    with pytest.raises(ValueError, match="scheme"):
        RowSharding(10, 2, "random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank"):
        RowSharding(10, 2).global_rows(2)
    with pytest.raises(ValueError, match="integer"):
        bucketize_by_shard(torch.zeros(3), RowSharding(10, 2))


def test_triton_large_ids(triton_device):
    for scheme in ("block", "hashed"):
        sharding = RowSharding(2**40, 512, scheme)
        ids = torch.tensor([0, 2**40 - 1, 2**33 + 5, 2**32 - 1, 2**32])
        want = bucketize_reference(ids, sharding)
        got = bucketize_by_shard(ids.to(triton_device), sharding, impl="triton")
        assert same(got[0], want[0]) and same(got[1], want[1]), scheme
