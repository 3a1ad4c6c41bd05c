import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.jagged.ops import lengths_to_offsets
from freescale.jagged.tensor import JaggedFeatures, JaggedTensor
from freescale.kernels import keyed_transpose, to_batch_major, to_feature_major
from freescale.kernels.transpose import keyed_transpose_eager, keyed_transpose_reference

from .strategies import feature_set, to_device


@st.composite
def grids(draw, max_keys: int = 4, max_batch: int = 5, max_len: int = 4):
    """Feature-major jagged features of K keys x B samples (K, B may be 0 or 1)."""
    keys = draw(st.integers(0, max_keys))
    batch = draw(st.integers(0, max_batch))
    lens = draw(
        st.lists(st.integers(0, max_len), min_size=keys * batch, max_size=keys * batch)
        | st.just([0] * (keys * batch))
    )
    seed = draw(st.integers(0, 2**16))
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    offsets = lengths_to_offsets(torch.tensor(lens, dtype=torch.int64))
    return JaggedFeatures(offsets, feature_set(sum(lens), seed, dtype)), keys, batch


def kjt_truth(feats: JaggedFeatures, keys: int, batch: int) -> list[list[torch.Tensor]]:
    """Per sample b, per key k: the values of (k, b), read from the feature-major layout."""
    bounds = feats.offsets.tolist()
    ids = feats.features["ids"]
    return [
        [ids[bounds[k * batch + b] : bounds[k * batch + b + 1]] for k in range(keys)]
        for b in range(batch)
    ]


@settings(max_examples=60, deadline=None)
@given(case=grids())
def test_batch_major_layout_is_per_sample_interleaved(case):
    feats, keys, batch = case
    out = to_batch_major(feats, keys) if keys else keyed_transpose(feats, 0, batch)
    out.validate("batch-major")
    segs = out.jagged("ids").segments()
    truth = kjt_truth(feats, keys, batch)
    for b in range(batch):
        for k in range(keys):
            assert torch.equal(segs[b * keys + k], truth[b][k])
    assert keyed_transpose_eager(feats, keys, batch).equal(out)


@settings(max_examples=60, deadline=None)
@given(case=grids())
def test_round_trip_is_identity(case):
    feats, keys, batch = case
    there = keyed_transpose(feats, keys, batch)
    assert keyed_transpose(there, batch, keys).equal(feats)
    if keys:
        assert to_feature_major(to_batch_major(feats, keys), keys).equal(feats)


@settings(max_examples=30, deadline=None)
@given(case=grids(), layout=st.sampled_from([None, "rows", "segment"]))
def test_triton_equals_reference(triton_device, case, layout):
    from freescale.kernels.triton_permute import keyed_transpose_triton

    feats, keys, batch = case
    ref = keyed_transpose_reference(feats, keys, batch)
    got = keyed_transpose_triton(to_device(feats, triton_device), keys, batch, layout=layout)
    assert got.equal(ref)
    back = keyed_transpose(got, batch, keys, impl="triton")
    assert back.equal(feats)


def test_jagged_tensor_and_errors():
    jt = JaggedTensor(torch.arange(5), torch.tensor([0, 1, 1, 3, 5]))  # K=2 x B=2
    out = to_batch_major(jt, 2)
    assert isinstance(out, JaggedTensor)
    assert out.offsets.tolist() == [0, 1, 3, 3, 5]
    assert out.values.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="multiple"):
        to_batch_major(jt, 3)
    with pytest.raises(ValueError, match="grid"):
        keyed_transpose(jt, 3, 2)
