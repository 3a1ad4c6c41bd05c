"""Triton kernels against the references at realistic shapes (CUDA only)."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_permute_realistic():
    from freescale.kernels import triton_permute as permute

    permute.check("cuda", num_segments=8192, mean_length=4000)  # long: segment-parallel
    permute.check("cuda", num_segments=200_000, mean_length=3)  # short: element-parallel


def test_transpose_realistic():
    from freescale.kernels.transpose import keyed_transpose, keyed_transpose_reference
    from freescale.kernels.triton_permute import random_case

    feats, _ = random_case(8 * 4096, 16, "cuda")
    want = keyed_transpose_reference(feats, 8, 4096)
    assert keyed_transpose(feats, 8, 4096, impl="triton").equal(want)


@pytest.mark.parametrize("world_size", [1, 8, 512, 4096])
def test_dispatch_realistic(world_size):
    from freescale.kernels import triton_dispatch as dispatch

    dispatch.check("cuda", n=512_000, world_size=world_size, dim=128)


@pytest.mark.parametrize("scheme", ["block", "hashed"])
def test_dispatch_ids_realistic(scheme):
    from freescale.kernels import RowSharding, ranged_dispatch_ids

    sharding = RowSharding(50_000_000, 512, scheme)
    ids = torch.randint(0, sharding.rows, (512_000,), device="cuda")
    ids[:2] = torch.tensor([0, sharding.rows - 1])
    for local in (True, False):
        got = ranged_dispatch_ids(ids, sharding, local=local, impl="triton")
        want = ranged_dispatch_ids(ids, sharding, local=local, impl="torch")
        assert torch.equal(got[0], want[0]) and torch.equal(got[1].positions, want[1].positions)
        assert torch.equal(got[1].counts, want[1].counts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_dispatch_and_combine_bf16(dtype):
    from freescale.kernels import apply_dispatch, ranged_combine, ranged_dispatch

    dest = torch.randint(0, 64, (100_000,), device="cuda")
    rows = torch.randn(100_000, 128, device="cuda").to(dtype)
    send, plan = ranged_dispatch(rows, dest, 64, impl="triton")
    ref_send, ref_plan = ranged_dispatch(rows, dest, 64, impl="torch")
    assert torch.equal(send, ref_send) and torch.equal(plan.positions, ref_plan.positions)
    assert torch.equal(apply_dispatch(rows, plan, impl="triton"), ref_send)
    assert torch.equal(ranged_combine(send, plan, impl="triton"), rows)


def test_rows_bucketize_collision_realistic():
    from freescale.kernels import triton_bucketize as bucketize
    from freescale.kernels import triton_collision as collision
    from freescale.kernels import triton_rows as rows

    rows.check("cuda", n=200_000, dim=128, world_size=256)
    bucketize.check("cuda", n=1_000_000)
    collision.check("cuda", n=1_000_000)
