import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.jagged import JaggedFeatures, JaggedTensor, SampleBatch
from freescale.jagged.ops import check_offsets, gather_positions, lengths_to_offsets
from freescale.testing.batches import random_batch

batches = st.builds(
    random_batch,
    seed=st.integers(0, 2**31),
    batch_size=st.integers(0, 12),
    max_uih=st.sampled_from([0, 1, 5]),
    max_candidates=st.sampled_from([0, 1, 3]),
    max_content=st.sampled_from([0, 2]),
    dense_dim=st.sampled_from([None, 3]),
)


def sample_parts(batch: SampleBatch, i: int) -> dict:
    """Everything about sample ``i``, read one sample at a time (the slow truth)."""
    u0, u1 = batch.uih.offsets[i : i + 2].tolist()
    c0, c1 = batch.candidates.offsets[i : i + 2].tolist()
    parts = {f"uih.{n}": t[u0:u1] for n, t in batch.uih.features.items()}
    parts |= {f"cand.{n}": t[c0:c1] for n, t in batch.candidates.features.items()}
    parts["labels"] = batch.labels[c0:c1]
    for c in range(c0, c1):
        k0, k1 = batch.content.offsets[c : c + 2].tolist()
        for n, t in batch.content.features.items():
            parts[f"content{c - c0}.{n}"] = t[k0:k1]
    parts["id"] = batch.sample_id[i : i + 1]
    if batch.dense is not None:
        parts["dense"] = batch.dense[i]
    return parts


def assert_sample_equal(a: SampleBatch, i: int, b: SampleBatch, j: int) -> None:
    pa, pb = sample_parts(a, i), sample_parts(b, j)
    assert pa.keys() == pb.keys()
    for k in pa:
        assert torch.equal(pa[k], pb[k]), k


@settings(max_examples=60, deadline=None)
@given(batch=batches, data=st.data())
def test_select_matches_per_sample_truth(batch, data):
    batch.validate()
    idx = data.draw(st.lists(st.integers(0, max(batch.batch_size - 1, 0)), max_size=15))
    if batch.batch_size == 0:
        idx = []
    out = batch.select(torch.tensor(idx, dtype=torch.int64))
    out.validate()
    assert out.batch_size == len(idx)
    for k, i in enumerate(idx):
        assert_sample_equal(out, k, batch, i)


@settings(max_examples=60, deadline=None)
@given(batch=batches, data=st.data())
def test_permutation_round_trip(batch, data):
    perm = torch.tensor(data.draw(st.permutations(range(batch.batch_size))), dtype=torch.int64)
    inverse = torch.argsort(perm)
    assert batch.select(perm).select(inverse).equal(batch)
    assert batch.select(torch.arange(batch.batch_size)).equal(batch)


@settings(max_examples=60, deadline=None)
@given(batch=batches, world=st.integers(1, 5), data=st.data())
def test_split_by_dest_then_concat(batch, world, data):
    dest = torch.tensor(
        data.draw(
            st.lists(
                st.integers(0, world - 1), min_size=batch.batch_size, max_size=batch.batch_size
            )
        ),
        dtype=torch.int64,
    )
    pieces = batch.split_by_dest(dest, world)
    assert len(pieces) == world
    for r, piece in enumerate(pieces):
        piece.validate()
        expected = torch.nonzero(dest == r).flatten()
        assert torch.equal(piece.sample_id, batch.sample_id[expected])
        assert piece.equal(batch.select(expected))
    merged = SampleBatch.concat(pieces)
    order = torch.sort(dest, stable=True).indices
    assert merged.select(torch.argsort(order)).equal(batch)


@settings(max_examples=40, deadline=None)
@given(batch=batches, data=st.data())
def test_slices_concat_to_the_batch(batch, data):
    cut = data.draw(st.integers(0, batch.batch_size))
    parts = [batch.slice(0, cut), batch.slice(cut, batch.batch_size)]
    assert SampleBatch.from_samples(parts).equal(batch)


def test_single_sample_and_empty_batch():
    one = random_batch(seed=1, batch_size=1)
    assert SampleBatch.concat([one, one]).select(torch.tensor([1])).sample_id.tolist() == [0]
    empty = random_batch(seed=2, batch_size=0, dense_dim=None)
    empty.validate()
    assert empty.split_by_dest(torch.zeros(0, dtype=torch.int64), 3)[2].batch_size == 0


def test_equal_detects_each_kind_of_difference():
    a = random_batch(seed=3, batch_size=6, max_uih=4, max_candidates=2)
    assert a.equal(a.select(torch.arange(6)))
    b = a.select(torch.arange(6))
    b.labels[0] = 1 - b.labels[0] if b.labels.numel() else b.labels
    assert b.labels.numel() == 0 or not a.equal(b)
    c = a.select(torch.arange(6))
    c.sample_id[0] += 100
    assert not a.equal(c)
    d = a.select(torch.arange(6))
    d.uih.features["actions"] = d.uih.features["actions"].to(torch.int32)
    assert not a.equal(d), "dtype must matter"


def test_to_device_and_pin_memory_keep_values():
    a = random_batch(seed=4, batch_size=5)
    assert a.to("cpu").equal(a)
    assert a.pin_memory().equal(a)
    assert a.num_bytes() > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_round_trip_and_pinning():
    a = random_batch(seed=5, batch_size=7)
    pinned = a.pin_memory()
    assert all(t.is_pinned() for t in pinned.tensors())
    on_gpu = pinned.to("cuda", non_blocking=True)
    on_gpu.record_stream(torch.cuda.current_stream())
    assert on_gpu.select(torch.tensor([3, 1])).to("cpu").equal(a.select(torch.tensor([3, 1])))


def test_bad_layouts_raise_value_error():
    with pytest.raises(ValueError, match="offsets end at 3 but there are 4 values"):
        check_offsets(torch.tensor([0, 1, 3]), 4, "uih")
    with pytest.raises(ValueError, match="negative length"):
        check_offsets(torch.tensor([0, 2, 1]), 1, "uih")
    with pytest.raises(ValueError, match="one segment per sample"):
        a = random_batch(seed=6, batch_size=3)
        SampleBatch(a.uih, a.candidates, a.labels, a.content, a.sample_id[:2])
    with pytest.raises(ValueError, match="equal first dims"):
        JaggedFeatures(torch.tensor([0, 2]), {"a": torch.zeros(2), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="dest values"):
        random_batch(seed=7, batch_size=3).split_by_dest(torch.tensor([0, 1, 5]), 2)


def test_jagged_tensor_select_and_segments():
    jt = JaggedTensor.from_lengths(torch.arange(6.0), torch.tensor([2, 0, 4]))
    assert [s.tolist() for s in jt.select(torch.tensor([2, 1, 0])).segments()] == [
        [2.0, 3.0, 4.0, 5.0],
        [],
        [0.0, 1.0],
    ]
    pos, offsets = gather_positions(lengths_to_offsets(torch.tensor([3, 1])), torch.tensor([1, 1]))
    assert pos.tolist() == [3, 3] and offsets.tolist() == [0, 1, 2]
