"""`freescale.kernels.linear.Linear` (bias gradient by `column_sums`) against ``nn.Linear``."""

import pytest
import torch

from freescale.kernels.linear import Linear, graph_body
from freescale.testing.tolerance import assert_reordered_close


@pytest.mark.numeric
@pytest.mark.parametrize("rows", [0, 1, 37, 300])
def test_linear_matches_nn_linear(triton_device, monkeypatch, rows):
    """Forward bitwise (autocast bf16 on CUDA, fp32 under the interpreter),
    every gradient to rounding."""
    torch.manual_seed(rows)
    plain = torch.nn.Linear(24, 40).to(triton_device)
    ours = Linear(24, 40).to(triton_device)
    ours.load_state_dict(plain.state_dict())
    x = torch.randn(rows, 24, device=triton_device)
    up = torch.randn(rows, 40, device=triton_device)
    amp = torch.autocast("cuda", torch.bfloat16, enabled=triton_device == "cuda")
    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    with amp:
        want = plain(xs[0])
    monkeypatch.setenv("FREESCALE_KERNELS", "triton")
    with amp, graph_body():
        got = ours(xs[1])
    assert got.grad_fn.name() == "_LinearBackward"
    assert got.dtype == want.dtype and torch.equal(got, want)
    (want.float() * up).sum().backward()
    (got.float() * up).sum().backward()
    # The same products in another kernel/order: the input gradient sums over
    # the 40 outputs, the weight and bias gradients over the rows (bf16 products
    # under autocast on CUDA).
    dtype = torch.bfloat16 if triton_device == "cuda" else torch.float32
    assert_reordered_close(xs[1].grad, xs[0].grad, terms=40, dtype=dtype)
    assert_reordered_close(ours.weight.grad, plain.weight.grad, terms=max(1, rows), dtype=dtype)
    assert_reordered_close(ours.bias.grad, plain.bias.grad, terms=max(1, rows), dtype=dtype)
    assert ours.weight.grad.dtype == torch.float32 and ours.bias.grad.dtype == torch.float32


def test_linear_is_nn_linear_outside_graph_bodies_without_bias_or_for_fp64(
    triton_device, monkeypatch
):
    monkeypatch.setenv("FREESCALE_KERNELS", "triton")
    x = torch.randn(5, 4, device=triton_device)
    m = Linear(4, 3).to(triton_device)
    assert m(x).grad_fn.name() == "AddmmBackward0"  # an eager step: torch's own
    with graph_body():
        assert Linear(4, 3, bias=False).to(triton_device)(x).grad_fn.name() == "MmBackward0"
        assert m.double()(x.double()).grad_fn.name() == "AddmmBackward0"
        assert m.float()(x).grad_fn.name() == "_LinearBackward"


def test_a_frozen_weight_or_input_saves_and_returns_only_what_is_needed(triton_device, monkeypatch):
    monkeypatch.setenv("FREESCALE_KERNELS", "triton")
    m = Linear(4, 3).to(triton_device)
    m.weight.requires_grad_(False)
    x = torch.randn(6, 4, device=triton_device, requires_grad=True)
    with graph_body():
        m(x).sum().backward()
    assert m.weight.grad is None and x.grad.shape == x.shape and m.bias.grad.shape == (3,)
    assert torch.equal(m.bias.grad.cpu(), torch.full((3,), 6.0))  # six ones: exact
