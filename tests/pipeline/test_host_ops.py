"""Fewer host operations, same numbers: each shortcut of the step path equals its twin."""

from __future__ import annotations

import math

import pytest
import torch

from freescale.embedding.nonfinite import nonfinite_in
from freescale.embedding.preflight import _constant_on, fingerprint

SHAPES = [(3, 4), (0,), (1,), (7,), (2, 0, 3), (5, 1)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("poison", [None, math.nan, math.inf, -math.inf, 3e38, -0.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_in_flags_exactly_nan_and_inf_and_changes_no_bit(seed, poison, dtype):
    g = torch.Generator().manual_seed(seed)
    shapes = SHAPES[: 1 + seed]
    grads = [(torch.randn(s, generator=g) * 10 ** (seed - 3)).to(dtype) for s in shapes]
    if poison is not None and grads[0].numel():
        grads[0].view(-1)[0] = poison  # 3e38: finite (its square would overflow)
    before = [t.clone() for t in grads]
    want = not all(bool(torch.isfinite(t).all()) for t in grads)
    assert bool(nonfinite_in(grads)) == want
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for a, b in zip(grads, before, strict=True):  # scaled by 1 in place: the same bits
        assert torch.equal(a.view(bits), b.view(bits))


@pytest.mark.parametrize("poison", [None, math.inf])
def test_nonfinite_in_mixed_dtypes_checks_each_tensor(poison):
    grads = [torch.randn(4), torch.randn(3, dtype=torch.float64)]
    if poison is not None:
        grads[1][1] = poison
    assert bool(nonfinite_in(grads)) == (poison is not None)


def test_fingerprint_tensor_is_copied_once_per_key_set():
    keys = ("b_feature", "a_feature")
    first = _constant_on((fingerprint(list(keys)),), torch.device("cpu"))
    again = _constant_on((fingerprint(list(keys)),), torch.device("cpu"))
    assert again is first
    assert first.tolist() == [fingerprint(list(keys))]
    other = _constant_on((fingerprint(["c_feature"]),), torch.device("cpu"))
    assert other.tolist() == [fingerprint(["c_feature"])] != first.tolist()
