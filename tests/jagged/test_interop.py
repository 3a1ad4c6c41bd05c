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
