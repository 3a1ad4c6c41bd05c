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


class NonFiniteGuard:
    """One device flag per backward: True when any rank saw a non-finite value.

    ``begin_step(loss)`` (before backward) adds a step's own evidence; each
    backward through the collection calls ``agree(grads)``, one small
    all-gather on ``comm`` (the same on every rank, as every rank runs every
    backward); ``step_flag()`` is the OR over the step's backwards.
    """

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        self._evidence: Tensor | None = None
        self._flags: list[Tensor] = []
        self._seen_here: list[Tensor] = []  # this rank's own evidence, per backward

    def begin_step(self, *tensors: Tensor) -> None:
        """A new step; ``tensors`` (e.g. the loss) count as evidence for its backwards."""
        self._flags, self._seen_here = [], []
        self._evidence = None
        for t in tensors:
            bad = ~torch.isfinite(t.detach()).all()
            self._evidence = bad if self._evidence is None else self._evidence | bad

    def agree(self, grads: Sequence[Tensor], device: torch.device) -> Tensor:
        """The global flag (0-dim bool on ``device``) of one backward; a collective."""
        finite = None
        for g in grads:
            ok = torch.isfinite(g).all()
            finite = ok if finite is None else finite & ok
        local = torch.zeros((), dtype=torch.bool, device=device) if finite is None else ~finite
        if self._evidence is not None:
            local = local | self._evidence.to(device)
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
