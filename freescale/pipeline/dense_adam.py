"""The dense optimizer: torch's fused Adam with less host work per step.

``torch.optim.Adam(fused=True).step`` rebuilds its lists of parameters,
gradients, moments and step counters on every call (a Python loop over every
parameter) before launching three multi-tensor ops. At one H200 and batch 32
the host is the bottleneck, and with ~50 dense parameters that loop is a
visible part of the step. `DenseAdam` keeps the lists while the parameters
with a gradient stay the same and launches the same three ops with the same
arguments: the same kernels, hence the same bits, and the same state dict.
Everything else (the first step, which creates the state; several groups;
amsgrad, maximize, capturable, differentiable, AdamW's decay; a tensor lr; a
gradient scale; a closure; mixed devices or dtypes) is ``Adam.step``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

_Lists = tuple[tuple[int, ...], list[Tensor], list[Tensor], list[Tensor], list[Tensor]]


class DenseAdam(torch.optim.Adam):
    """``torch.optim.Adam(params, lr=lr, fused=True)``, its step's lists kept."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float) -> None:
        super().__init__(params, lr=lr, fused=True)
        self._lists: _Lists | None = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        lists = None if closure is not None else self._reused_lists()
        if lists is None:
            self._lists = None
            return super().step(closure)
        _, params, exp_avgs, exp_avg_sqs, steps = lists
        group = self.param_groups[0]
        beta1, beta2 = group["betas"]
        found_inf = getattr(self, "found_inf", None)
        # What `torch.optim.adam._fused_adam` launches for one device and dtype.
        torch._foreach_add_(steps, 1)
        torch._fused_adam_(
            params, [p.grad for p in params], exp_avgs, exp_avg_sqs, [], steps,
            amsgrad=False, lr=group["lr"], beta1=float(beta1), beta2=float(beta2),
            weight_decay=group["weight_decay"], eps=group["eps"], maximize=False,
            grad_scale=None, found_inf=found_inf,
        )  # fmt: skip
        if found_inf is not None:
            torch._foreach_sub_(steps, [found_inf] * len(steps))
        return None

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._lists = None  # new state tensors

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._lists = None

    def _reused_lists(self) -> _Lists | None:
        """The step's lists, from the last step when its parameters with a
        gradient are the same; None where ``Adam.step`` must run."""
        if len(self.param_groups) != 1 or getattr(self, "grad_scale", None) is not None:
            return None
        group = self.param_groups[0]
        if any(group[k] for k in ("amsgrad", "maximize", "capturable", "differentiable")):
            return None
        if group.get("decoupled_weight_decay", False) or isinstance(group["lr"], Tensor):
            return None
        params = [p for p in group["params"] if p.grad is not None]
        key = tuple(map(id, params))
        if self._lists is not None and self._lists[0] == key:
            return self._lists
        if not params or not self._plain(params):
            return None
        states = [self.state[p] for p in params]
        self._lists = (
            key,
            params,
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [s["step"] for s in states],
        )
        return self._lists

    def _plain(self, params: list[Tensor]) -> bool:
        """Every parameter has its state already (torch creates it) and shares one
        device and float dtype with its gradient and the others."""
        first = params[0]
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and found_inf.device != first.device:
            return False
        for p in params:
            state = self.state.get(p)
            if not state or "exp_avg" not in state or not isinstance(state.get("step"), Tensor):
                return False
            grad = p.grad
            assert grad is not None
            if p.device != first.device or p.dtype != first.dtype or torch.is_complex(p):
                return False
            if grad.is_sparse or grad.dtype != p.dtype or state["step"].device != p.device:
                return False
        return True
