"""`GradSum`: the sum over ranks of parameters' gradients, overlapped with backward.

What DDP's reducer does for replicated parameters, with a layout that is a
function of the parameters alone. DDP regroups its buckets by the order the
gradients arrived in the first backward, so a run resumed from a checkpoint
reduces its first step in another grouping than the run it resumes; from 3
ranks on the bits of a sum depend on an element's place in the buffer (the
ring all-reduce sums each chunk starting at another rank). Here the buckets
never change: the parameters in registration order, cut where a bucket
reaches its cap (the first, whose gradients arrive last in backward, small as
DDP's first, so the exposed tail is short), launched from the last
registered to the first.

Per step: `arm`, then backward: each parameter's post-accumulate-grad hook
counts it ready; a bucket whose parameters are all ready is copied into its
flat buffer, the ``.grad`` become views of it, and it is all-reduced
asynchronously while backward goes on. Buckets are launched in their fixed
order (every rank issues the same collectives in the same order, whatever
order its gradients arrive in). `finish` launches what is left (a parameter
that got no gradient on this rank adds zeros) and waits: with NCCL the
current stream waits for the reduction, with gloo the host does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket
BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


def cut_buckets(
    params: list[nn.Parameter], first_bytes: int = FIRST_BUCKET_BYTES,
    bucket_bytes: int = BUCKET_BYTES,
) -> list[list[nn.Parameter]]:  # fmt: skip
    """``params`` in their order, cut into buckets in launch order (the last
    cut first). A bucket closes once it holds ``first_bytes`` (the first cut)
    or ``bucket_bytes`` (the others), or at a change of dtype or device."""
    cuts: list[list[nn.Parameter]] = [[]]
    size = 0
    for p in params:
        kind = (p.dtype, p.device)
        if cuts[-1] and kind != (cuts[-1][0].dtype, cuts[-1][0].device):
            cuts.append([])
            size = 0
        cuts[-1].append(p)
        size += p.numel() * p.element_size()
        if size >= (first_bytes if len(cuts) == 1 else bucket_bytes):
            cuts.append([])
            size = 0
    return [c for c in reversed(cuts) if c]


class _Bucket:
    """Parameters whose gradients are reduced together, through one flat buffer."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        first = params[0]
        total = sum(p.numel() for p in params)
        self.flat = torch.zeros(total, dtype=first.dtype, device=first.device)
        self.views, at = [], 0
        for p in params:
            self.views.append(self.flat[at : at + p.numel()].view_as(p))
            at += p.numel()

    def gather(self) -> None:
        """The gradients into the buffer (zeros for none); the ``.grad`` its views."""
        src, dst = [], []
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr():
                src.append(p.grad)
                dst.append(view)
            p.grad = view
        if src:
            torch._foreach_copy_(dst, src)


class GradSum:
    """Sums the gradients of ``params`` over ``group``'s ranks (see the module
    docstring); ``on_launch()`` is called before each bucket's all-reduce.
    The ranks' parameters start equal: rank 0's are broadcast, as DDP does."""

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: Any = None,
        on_launch: Callable[[], None] | None = None,
        first_bytes: int = FIRST_BUCKET_BYTES,
        bucket_bytes: int = BUCKET_BYTES,
    ) -> None:
        trained = [p for p in params if p.requires_grad]
        self.group, self.on_launch = group, on_launch
        self.buckets = [_Bucket(b) for b in cut_buckets(trained, first_bytes, bucket_bytes)]
        self._broadcast_from_rank_0()
        self.hooks = [
            p.register_post_accumulate_grad_hook(partial(self._ready, i))
            for i, bucket in enumerate(self.buckets)
            for p in bucket.params
        ]
        self.pending: list[int] | None = None  # None: no step armed, hooks do nothing
        self.launched = 0
        self.works: list[Any] = []

    def arm(self) -> None:
        """The next backward's gradients are summed (by `finish` at the latest)."""
        self.pending = [len(b.params) for b in self.buckets]
        self.launched, self.works = 0, []

    def finish(self) -> None:
        """Launches the buckets not yet launched and waits for all of them."""
        if self.pending is None:
            return
        while self.launched < len(self.buckets):
            self._launch()
        for work in self.works:
            work.wait()
        self.pending, self.works = None, []

    def remove(self) -> None:
        """Unhooks the parameters."""
        for h in self.hooks:
            h.remove()

    def _ready(self, index: int, _param: Tensor) -> None:
        if self.pending is None:
            return
        self.pending[index] -= 1
        while self.launched < len(self.buckets) and self.pending[self.launched] == 0:
            self._launch()

    def _launch(self) -> None:
        bucket = self.buckets[self.launched]
        bucket.gather()
        if self.on_launch is not None:
            self.on_launch()
        self.works.append(dist.all_reduce(bucket.flat, group=self.group, async_op=True))
        self.launched += 1

    @torch.no_grad()
    def _broadcast_from_rank_0(self) -> None:
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for b in self.buckets:
            torch._foreach_copy_(b.views, b.params)
            dist.broadcast(b.flat, src, group=self.group)
            torch._foreach_copy_(b.params, b.views)
