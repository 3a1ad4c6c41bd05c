"""Fewer host operations, same numbers: each shortcut of the step path equals its twin."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from freescale.embedding.preflight import _constant_on, fingerprint
from freescale.pipeline.nonfinite import total_norm

SHAPES = [(3, 4), (0,), (1,), (7,), (2, 0, 3), (5, 1)]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("poison", [None, math.nan, math.inf, -math.inf, 3e38])
def test_total_norm_equals_torchs_bit_for_bit(seed, poison):
    g = torch.Generator().manual_seed(seed)
    shapes = SHAPES[: 1 + seed]
    grads = [torch.randn(s, generator=g) * 10 ** (seed - 3) for s in shapes]
    if poison is not None and grads[0].numel():
        grads[0].view(-1)[0] = poison  # 3e38: finite values whose norm overflows
    got, want = total_norm(grads), nn.utils.get_total_norm(grads)
    assert torch.equal(got, want) or (got.isnan() and want.isnan())
    assert bool(torch.isfinite(got)) == bool(torch.isfinite(want))


def test_total_norm_of_mixed_dtypes_goes_to_torchs():
    grads = [torch.randn(4), torch.randn(3, dtype=torch.float64)]
    assert torch.equal(total_norm(grads), nn.utils.get_total_norm(grads))


def test_fingerprint_tensor_is_copied_once_per_key_set():
    keys = ("b_feature", "a_feature")
    first = _constant_on((fingerprint(list(keys)),), torch.device("cpu"))
    again = _constant_on((fingerprint(list(keys)),), torch.device("cpu"))
    assert again is first
    assert first.tolist() == [fingerprint(list(keys))]
    other = _constant_on((fingerprint(["c_feature"]),), torch.device("cpu"))
    assert other.tolist() == [fingerprint(["c_feature"])] != first.tolist()
