import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.jagged import JaggedTensor
from freescale.jagged.interop import from_kjt, from_nested, to_kjt, to_nested
from freescale.testing.batches import random_batch

HAS_TORCHREC = importlib.util.find_spec("torchrec") is not None


@pytest.mark.skipif(not HAS_TORCHREC, reason="needs the torchrec extra")
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), b=st.integers(0, 9))
def test_kjt_round_trip(seed, b):
    batch = random_batch(seed=seed, batch_size=b)
    kjt = to_kjt(batch)
    assert kjt.keys()[0] == "uih/item_ids"
    # feature-major: the first key's values are the UIH item ids of all samples
    n_uih = batch.uih.features["item_ids"].numel()
    assert torch.equal(kjt.values()[:n_uih], batch.uih.features["item_ids"])
    back = from_kjt(kjt, batch.labels, batch.sample_id, batch.dense)
    assert back.equal(batch)


@pytest.mark.skipif(not HAS_TORCHREC, reason="needs the torchrec extra")
def test_kjt_rejects_float_features():
    batch = random_batch(seed=1, batch_size=3)
    batch.uih.features["timestamps"] = batch.uih.features["timestamps"].float()
    with pytest.raises(ValueError, match="integer dtype"):
        to_kjt(batch)


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 5), min_size=0, max_size=8), dim=st.sampled_from([0, 3]))
def test_nested_round_trip(lengths, dim):
    total = sum(lengths)
    values = torch.randn(total, dim) if dim else torch.arange(total)
    jt = JaggedTensor.from_lengths(values, torch.tensor(lengths, dtype=torch.int64))
    nt = to_nested(jt)
    assert nt.is_nested and nt.size(0) == len(lengths)
    assert from_nested(nt).equal(jt)


def _kjt(spec: dict, stride: int):
    """Feature-major KJT from ``{key: (values, per-sample lengths)}``."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    return KeyedJaggedTensor(
        keys=list(spec),
        values=torch.tensor([v for vals, _ in spec.values() for v in vals], dtype=torch.int64),
        lengths=torch.tensor([n for _, lens in spec.values() for n in lens], dtype=torch.int32),
        stride=stride,
    )


def _valid_spec() -> dict:
    # 2 samples: UIH lengths (1, 2); candidates (2, 1) whose content lengths
    # are (1, 2 | 1), so the per-sample content lengths are (3, 1).
    return {
        "uih/item_ids": ([10, 11, 12], [1, 2]),
        "uih/actions": ([20, 21, 22], [1, 2]),
        "cand/item_ids": ([30, 31, 32], [2, 1]),
        "content/tok": ([40, 41, 42, 43], [3, 1]),
        "content_lengths": ([1, 2, 1], [2, 1]),
    }


def _from(spec: dict, batch_size: int = 2, stride: int = 2):
    return from_kjt(_kjt(spec, stride), torch.zeros(3), torch.arange(batch_size))


@pytest.mark.skipif(not HAS_TORCHREC, reason="needs the torchrec extra")
def test_kjt_hand_built_example_decodes():
    batch = _from(_valid_spec())
    assert batch.uih.lengths().tolist() == [1, 2]
    assert batch.candidates.lengths().tolist() == [2, 1]
    assert batch.content.lengths().tolist() == [1, 2, 1]
    assert batch.content.features["tok"].tolist() == [40, 41, 42, 43]
    assert from_kjt(to_kjt(batch), batch.labels, batch.sample_id).equal(batch)


@pytest.mark.skipif(not HAS_TORCHREC, reason="needs the torchrec extra")
def test_kjt_group_lengths_disagree_raises_naming_the_key():
    # A past bug: the last key's offsets were applied to the whole group, so
    # item_ids came back [[10, 11], [12]] instead of [[10], [11, 12]].
    spec = {
        "uih/item_ids": ([10, 11, 12], [1, 2]),
        "uih/actions": ([20, 21, 22], [2, 1]),
        "content_lengths": ([], [0, 0]),
    }
    with pytest.raises(ValueError, match=r"'uih/actions'.*'uih/item_ids'"):
        from_kjt(_kjt(spec, 2), torch.zeros(0), torch.arange(2))


def _corrupt(what: str) -> tuple[dict, dict]:
    spec, kw = _valid_spec(), {}
    if what == "cand_vs_content_lengths":
        spec["cand/item_ids"] = ([30, 31, 32], [1, 2])
    elif what == "content_vs_content_lengths":
        spec["content/tok"] = ([40, 41, 42, 43], [2, 2])
    elif what == "negative_content_length":
        spec["content_lengths"] = ([-1, 4, 1], [2, 1])
    elif what == "negative_length":
        spec["uih/item_ids"] = ([10, 11, 12], [-1, 4])
        spec["uih/actions"] = ([20, 21, 22], [-1, 4])
    elif what == "too_few_values":
        spec["content_lengths"] = ([1, 2], [2, 1])
    elif what == "too_many_values":
        spec["content_lengths"] = ([1, 2, 1, 7], [2, 1])
    elif what == "missing_content_lengths":
        del spec["content_lengths"]
    elif what == "wrong_stride":
        kw = {"batch_size": 3}
    return spec, kw


@pytest.mark.skipif(not HAS_TORCHREC, reason="needs the torchrec extra")
@pytest.mark.parametrize(
    ("what", "match"),
    [
        ("cand_vs_content_lengths", r"'content_lengths'.*'cand/item_ids'"),
        ("content_vs_content_lengths", r"'content/tok'.*'content_lengths'"),
        ("negative_content_length", r"'content_lengths'.*negative"),
        ("negative_length", r"'uih/item_ids'.*negative"),
        ("too_few_values", r"'content_lengths'.*values"),
        ("too_many_values", r"'content_lengths'.*values"),
        ("missing_content_lengths", r"'content_lengths'.*'content/tok'"),
        ("wrong_stride", r"stride 2.*batch size 3.*'uih/item_ids'"),
    ],
)
def test_kjt_inconsistencies_raise_naming_the_key(what, match):
    spec, kw = _corrupt(what)
    with pytest.raises(ValueError, match=match):
        _from(spec, **kw)


@pytest.mark.skipif(not HAS_TORCHREC, reason="needs the torchrec extra")
def test_kjt_duplicate_key_raises():
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    base = _kjt(_valid_spec(), 2)
    kjt = KeyedJaggedTensor(
        keys=["uih/item_ids", *base.keys()],
        values=torch.cat([torch.tensor([10, 11, 12]), base.values()]),
        lengths=torch.cat([torch.tensor([1, 2], dtype=torch.int32), base.lengths()]),
        stride=2,
    )
    with pytest.raises(ValueError, match=r"'uih/item_ids'.*more than once"):
        from_kjt(kjt, torch.zeros(3), torch.arange(2))
