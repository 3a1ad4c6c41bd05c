"""`freescale.models.linear.Linear` (bias gradient by `column_sums`) against ``nn.Linear``."""

import pytest
import torch

from freescale.models.linear import Linear


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
    with amp:
        got = ours(xs[1])
    assert got.dtype == want.dtype and torch.equal(got, want)
    (want.float() * up).sum().backward()
    (got.float() * up).sum().backward()
    tol = dict(rtol=2e-2, atol=2e-2) if triton_device == "cuda" else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(xs[1].grad, xs[0].grad, **tol)
    torch.testing.assert_close(ours.weight.grad, plain.weight.grad, **tol)
    torch.testing.assert_close(ours.bias.grad, plain.bias.grad, **tol)
    assert ours.weight.grad.dtype == torch.float32 and ours.bias.grad.dtype == torch.float32


def test_linear_without_bias_or_triton_is_nn_linear():
    x = torch.randn(5, 4)
    m = Linear(4, 3)
    assert torch.equal(m(x), torch.nn.functional.linear(x, m.weight, m.bias))
    assert Linear(4, 3, bias=False)(x).grad_fn.name() != "_LinearBackward"
