import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.jagged.tensor import JaggedFeatures, JaggedTensor
from freescale.kernels import indexed_permute
from freescale.kernels.permute import indexed_permute_eager, indexed_permute_reference

from .strategies import jagged_features, selections, to_device


def per_segment_truth(feats: JaggedFeatures, indices: torch.Tensor) -> dict[str, list]:
    """Selected segments read one at a time with Python slicing."""
    bounds = feats.offsets.tolist()
    return {
        n: [t[bounds[i] : bounds[i + 1]] for i in indices.tolist()]
        for n, t in feats.features.items()
    }


def assert_matches_truth(out: JaggedFeatures, feats: JaggedFeatures, indices: torch.Tensor) -> None:
    truth = per_segment_truth(feats, indices)
    out.validate("permuted")
    assert out.num_segments == indices.numel()
    for name, pieces in truth.items():
        got = out.jagged(name).segments()
        assert len(got) == len(pieces)
        assert all(torch.equal(a, b) for a, b in zip(got, pieces, strict=True)), name


@settings(max_examples=60, deadline=None)
@given(feats=jagged_features(), data=st.data())
def test_reference_and_eager_match_per_segment_truth(feats, data):
    indices = data.draw(selections(feats.num_segments))
    ref = indexed_permute_reference(feats, indices)
    assert_matches_truth(ref, feats, indices)
    assert indexed_permute_eager(feats, indices).equal(ref)


@settings(max_examples=30, deadline=None)
@given(
    feats=jagged_features(),
    data=st.data(),
    layout=st.sampled_from([None, "rows", "segment"]),
    block_rows=st.sampled_from([None, 2, 8]),
    pass_total=st.booleans(),
)
def test_triton_equals_reference(triton_device, feats, data, layout, block_rows, pass_total):
    from freescale.kernels.triton_permute import indexed_permute_triton

    indices = data.draw(selections(feats.num_segments))
    ref = indexed_permute_reference(feats, indices)
    total = int(ref.offsets[-1]) if pass_total else None
    got = indexed_permute_triton(
        to_device(feats, triton_device),
        indices.to(triton_device),
        total,
        layout=layout,
        block_rows=block_rows,
    )
    assert got.equal(ref)


@settings(max_examples=10, deadline=None)
@given(feats=jagged_features(), data=st.data())
def test_public_function_paths_agree(triton_device, feats, data):
    indices = data.draw(selections(feats.num_segments))
    ref = indexed_permute(feats, indices, impl="torch")
    assert indexed_permute(feats, indices, impl="eager").equal(ref)
    dev = to_device(feats, triton_device)
    assert indexed_permute(dev, indices.to(triton_device), impl="triton").equal(ref)


def test_jagged_tensor_in_jagged_tensor_out():
    jt = JaggedTensor(torch.arange(6), torch.tensor([0, 2, 2, 6]))
    out = indexed_permute(jt, torch.tensor([2, 0, 2]), total=10)
    assert isinstance(out, JaggedTensor)
    assert out.offsets.tolist() == [0, 4, 6, 10]
    assert out.values.tolist() == [2, 3, 4, 5, 0, 1, 2, 3, 4, 5]


def test_no_features_only_offsets():
    feats = JaggedFeatures(torch.tensor([0, 3, 5]), {})
    out = indexed_permute(feats, torch.tensor([1, 1]))
    assert out.offsets.tolist() == [0, 2, 4] and out.features == {}


def test_triton_needs_cuda_or_interpreter_message(triton_device):
    """A compiled-kernel launch on CPU must fail with a clear message, not crash."""
    from freescale.kernels.triton_common import check_launchable

    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        check_launchable(lambda: None, torch.device("cpu"))
