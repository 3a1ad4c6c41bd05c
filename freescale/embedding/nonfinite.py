"""Every rank agrees, on the device, whether a step saw a non-finite value.

The sparse update is fused into backward, so the decision to skip a step has
to be taken there, before the first row is written, and without asking the
host (that would make it wait for the GPU in the middle of backward). Each
rank ORs its own evidence (its loss, the gradients that reach the tables)
into one flag, the ranks all-gather the flags, and the update kernels read the
result on the device: the way mixed-precision gradient scalers skip an
optimizer step. Every dense layer's input gradient flows into the embedding
gradient, so a NaN or Inf anywhere upstream of the tables shows up here.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from freescale.comm import Communicator


def nonfinite_in(grads: list[Tensor]) -> Tensor:
    """0-dim bool: some element of ``grads`` (a non-empty list) is NaN or infinite.

    Where every gradient is a float tensor on one device: the gradient
    scaler's multi-tensor check at scale 1, one kernel and no tensor per
    gradient (a total norm made one per gradient, then stacked them). It
    rewrites each gradient as ``g * 1``, which keeps every finite bit
    (-0.0 included). Else one check per tensor.
    """
    first = grads[0]
    floats = (torch.float32, torch.float16, torch.bfloat16)
    if all(g.device == first.device and g.dtype in floats for g in grads):
        found = torch.zeros(1, dtype=torch.float32, device=first.device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, _one(first.device))
        return found[0] > 0
    return ~torch.stack([torch.isfinite(g).all() for g in grads]).all()


_ONES: dict[torch.device, Tensor] = {}


def _one(device: torch.device) -> Tensor:
    """A ``[1]`` float 1 on ``device``, made once (the check only reads it)."""
    if device not in _ONES:
        _ONES[device] = torch.ones(1, dtype=torch.float32, device=device)
    return _ONES[device]


class NonFiniteGuard:
    """One device flag per backward: True when any rank saw a non-finite value.

    ``begin_step(loss)`` (before backward) adds a step's own evidence; each
    backward through the collection calls ``agree(grads)``, one small
    all-gather on ``comm`` (the same on every rank, as every rank runs every
    backward); ``step_flag()`` is the OR over the step's backwards.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._evidence: list[Tensor] = []
        self._flags: list[Tensor] = []
        self._seen_here: list[Tensor] = []  # this rank's own evidence, per backward

    def begin_step(self, *tensors: Tensor) -> None:
        """A new step; ``tensors`` (e.g. the loss) count as evidence for its backwards."""
        self._flags, self._seen_here = [], []
        # Copies: each backward's check rewrites what it checks (as ``x * 1``),
        # and the loss itself must stay untouched while autograd may read it.
        self._evidence = [t.detach().clone() for t in tensors]

    def agree(self, grads: Sequence[Tensor], device: torch.device) -> Tensor:
        """The global flag (0-dim bool on ``device``) of one backward; a collective."""
        checked = [*grads, *(t.to(device) for t in self._evidence)]
        if checked:  # one multi-tensor check for the step's evidence and gradients
            local = nonfinite_in(checked)
        else:
            local = torch.zeros((), dtype=torch.bool, device=device)
        if self.comm.world_size == 1:  # the gather of one rank's flag is that flag
            flag = local
        else:
            flags = self.comm.all_gather(local.to(torch.float32).reshape(1)).wait()
            flag = flags.amax() > 0
        self._flags.append(flag)
        self._seen_here.append(local)
        return flag

    def step_flag(self) -> Tensor | None:
        """OR of this step's backward flags (None: no backward through the tables)."""
        return _any(self._flags)

    def seen_here(self) -> Tensor | None:
        """Whether this rank's own evidence was non-finite in this step."""
        return _any(self._seen_here)


def _any(flags: list[Tensor]) -> Tensor | None:
    if not flags:
        return None
    out = flags[0]
    for f in flags[1:]:
        out = out | f
    return out
