import pytest
import torch
from hypothesis import given, settings

from freescale.jagged import JaggedFeatures, SampleBatch
from freescale.jagged.packed import ALIGN, pack
from freescale.pipeline.loader import Prefetcher
from freescale.testing.batches import random_batch
from tests.jagged.test_batch import batches


def _same_tensors(a: SampleBatch, b: SampleBatch) -> None:
    assert a.equal(b)
    for x, y in zip(a.tensors(), b.tensors(), strict=True):
        assert (x.dtype, x.shape) == (y.dtype, y.shape)


@settings(max_examples=60, deadline=None)
@given(batches)
def test_unpack_gives_the_batch_back_as_views_of_one_buffer(batch):
    packed = pack(batch)
    out = packed.unpack()
    _same_tensors(out, batch)
    assert {t.untyped_storage().data_ptr() for t in out.tensors()} == {
        packed.data.untyped_storage().data_ptr()
    }
    assert all(s.start % ALIGN == 0 for s in packed.specs)


def test_mixed_dtypes_odd_sizes_and_empty_parts():
    base = random_batch(seed=7, batch_size=5, max_uih=3)
    uih = dict(base.uih.features)
    uih["actions"] = uih["actions"].to(torch.int8)  # 1 byte: the next tensor must realign
    uih["flags"] = torch.ones(base.uih.features["actions"].shape, dtype=torch.bool)
    uih["weights"] = torch.rand(uih["flags"].shape, dtype=torch.float16)
    odd = SampleBatch(
        uih=JaggedFeatures(base.uih.offsets.to(torch.int64), uih),
        candidates=base.candidates,
        labels=base.labels.double(),
        content=base.content,
        sample_id=base.sample_id.to(torch.int32),
        dense=torch.randn(5, 3, dtype=torch.bfloat16),
    )
    _same_tensors(pack(odd).unpack(), odd)
    empty = random_batch(seed=8, batch_size=0, dense_dim=None)
    _same_tensors(pack(empty).unpack(), empty)
    assert pack(empty).unpack().dense is None


class _Source:
    def batch(self, step, rank, world_size, batch_size):
        return random_batch(seed=step * 10 + rank, batch_size=batch_size if step % 3 else 0)


@pytest.mark.parametrize("workers", [0, 2])
def test_prefetcher_hands_out_the_same_batches_packed_or_not(workers):
    got = {}
    for packed in (False, True):
        loader = Prefetcher(
            _Source(), 1, 2, 4, torch.device("cpu"), range(7), workers=workers, packed=packed
        )
        try:
            got[packed] = [loader.get() for _ in range(7)]
        finally:
            loader.close()
    for (a, info_a), (b, info_b) in zip(got[False], got[True], strict=True):
        _same_tensors(a, b)
        assert info_a == info_b


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_packed_batch_pins_and_copies_in_one_piece():
    batch = random_batch(seed=9, batch_size=6)
    pinned = pack(batch).pin_memory()
    assert pinned.data.is_pinned()
    on_gpu = pinned.to("cuda", non_blocking=True).unpack()
    assert on_gpu.device.type == "cuda"
    _same_tensors(on_gpu.to("cpu"), batch)
