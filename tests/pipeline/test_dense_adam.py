"""`DenseAdam` takes torch's fused Adam steps bit for bit, with its lists reused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from freescale.pipeline.dense_adam import DenseAdam

SHAPES = [(5, 3), (7,), (1,), (4, 2, 2), (0,)]


def _params(device: str) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(1)
    return [nn.Parameter(torch.randn(s, generator=g).to(device)) for s in SHAPES]


def _run(make, device: str) -> tuple[list[torch.Tensor], dict]:
    """Eight steps: found_inf on and off, one parameter without a gradient for
    two steps, the lr and the decay edited, a state dict loaded mid-run."""
    params = _params(device)
    opt = make(params)
    g = torch.Generator().manual_seed(2)
    for step in range(8):
        for k, p in enumerate(params):
            p.grad = None if (k == 1 and step in (3, 4)) else torch.randn(p.shape, generator=g)
            if p.grad is not None:
                p.grad = p.grad.to(device)
        opt.found_inf = torch.tensor(float(step == 2), device=device)
        if step == 5:
            opt.param_groups[0]["lr"] = 3e-3
            opt.param_groups[0]["weight_decay"] = 0.1
        if step == 6:
            opt.load_state_dict(opt.state_dict())
        opt.step()
    return [p.detach().clone() for p in params], opt.state_dict()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")])],
)  # fmt: skip
def test_dense_adam_equals_torch_fused_adam_bit_for_bit(device):
    want, want_state = _run(lambda ps: torch.optim.Adam(ps, lr=1e-3, fused=True), device)
    got, got_state = _run(lambda ps: DenseAdam(ps, lr=1e-3), device)
    for a, b in zip(got, want, strict=True):
        assert _same(a, b)
    assert got_state["param_groups"] == want_state["param_groups"]
    for k, s in want_state["state"].items():
        for name, t in s.items():
            assert _same(got_state["state"][k][name].float(), t.float()), (k, name)


def test_dense_adam_reuses_its_lists_until_the_gradients_change():
    params = _params("cpu")
    opt = DenseAdam(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()  # torch's step creates the state
    assert opt._lists is None
    opt.step()
    lists = opt._lists
    assert lists is not None and lists[1] == params
    opt.step()
    assert opt._lists is lists
    params[0].grad = None
    opt.step()
    assert opt._lists is not lists and len(opt._lists[1]) == len(params) - 1
    opt.param_groups[0]["maximize"] = True  # not on the short path: torch's step
    opt.step()
    assert opt._lists is None
