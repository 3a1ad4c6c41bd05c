"""Dense training: the replicated model's optimizer, gradient sync and guard.

Built from the ``dense`` and ``faults`` sections: Adam over the dense
parameters, their gradients' *sum* all-reduce (`DenseSync`), bf16 autocast, CUDA
graphs of the model's block stack (`freescale.pipeline.graphs`) or regional
``torch.compile`` of its blocks (`freescale.pipeline.compile`) and the
non-finite guard's skip flags and count (`freescale.pipeline.nonfinite`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from freescale.comm.grad_sum import GradSum
from freescale.config import DenseSection, FaultsSection, RunSection
from freescale.kernels.attention import cudnn_sdpa
from freescale.models.blocks import attention_in_use, check_attention_device
from freescale.models.dropout import training_step
from freescale.observe.timing import SectionTimer
from freescale.pipeline.compile import compile_regions, compile_state, compiled_frames
from freescale.pipeline.graphs import BlockGraphs, install_graphs
from freescale.pipeline.lr_schedule import lr_schedule
from freescale.pipeline.nonfinite import NonFiniteCount, skip_flags


class GuardedAdam(torch.optim.Adam):
    """Fused Adam whose step takes the step's non-finite flag on the device
    (``found_inf``, as gradient scalers pass it): a skipped step leaves weights,
    moments and its step count alone without the host reading the flag."""

    def __init__(self, params: list[nn.Parameter], lr: float, weight_decay: float = 0.0) -> None:
        if not weight_decay:
            super().__init__(params, lr=lr, fused=True)
            return
        # AdamW on the weight matrices; biases and norm scales keep their values' scale
        matrices = [p for p in params if p.dim() >= 2]
        others = [p for p in params if p.dim() < 2]
        groups = [{"params": matrices, "weight_decay": weight_decay}, {"params": others}]
        groups = [g for g in groups if g["params"]]
        super().__init__(groups, lr=lr, fused=True, decoupled_weight_decay=True)

    def set_lr(self, lr: float) -> None:
        for group in self.param_groups:
            group["lr"] = lr

    def step_unless(self, found_inf: Tensor) -> None:  # type: ignore[override]
        self.found_inf = found_inf  # read by the fused kernel (`torch.optim.Adam.step`)
        self.step()


class DenseSync:
    """The dense gradients' *sum* all-reduce over the ranks (`GradSum`).

    A sum, not DDP's average: our loss is already normalized by the global
    candidate count. The buckets are fixed by the parameters' registration
    (the same on a fresh and on a resumed run, so a resume is bit-identical at
    any world size) and launched from backward's hooks as they fill. The last
    launch is marked: from there to the end of backward is the dense
    all-reduce time the compute stream is exposed to. On one rank there is
    nothing to reduce (``reduce`` is None).
    """

    def __init__(self, model: nn.Module, mark: Any) -> None:
        self.mark = mark
        self.last_ready: tuple[int, object] | None = None
        self.model = model
        self.reduce: GradSum | None = None
        # One rank: the sum all-reduce is the identity, and a copy per gradient
        # into a bucket would cost a kernel each for the same numbers. The
        # sharded tables live outside the module tree: only dense parameters.
        # Buffers a model updates in forward (running statistics) go from rank 0
        # to every rank before each forward, as DDP's default does; none: no cost.
        self.buffers: list[Tensor] = []
        if dist.get_world_size() > 1:
            self.reduce = GradSum(model.parameters(), on_launch=self._launched)
            self.buffers = list(model.buffers())

    @torch.no_grad()
    def share_buffers(self) -> None:
        """Rank 0's buffers on every rank (before a training forward)."""
        for b in self.buffers:
            dist.broadcast(b, 0)

    def _launched(self) -> None:
        self.last_ready = self.mark()

    def cover_all(self, loss: Tensor) -> Tensor:
        """``loss`` + 0 x one element of every dense parameter.

        With an empty local batch (or no UIH tokens, or no candidates) some
        parameters get no gradient at all on this rank; their buckets would
        then wait for `GradSum.finish` instead of leaving during backward.
        The zero term gives every parameter a (zero) gradient and changes no
        value.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        return loss + sum(p.reshape(-1)[:1].sum() for p in params) * 0.0

    def arm(self) -> None:
        """The next backward's gradients are summed over the ranks."""
        self.last_ready = None
        if self.reduce is not None:
            self.reduce.arm()

    def finish(self) -> None:
        """Waits for the sum (after backward, before the optimizer reads it)."""
        if self.reduce is not None:
            self.reduce.finish()


def graphs_skipped(section: DenseSection, step_tokens: int) -> str:
    """Why ``dense.graphs=true`` runs eagerly for batches of ``step_tokens`` UIH
    tokens ("" when it does not)."""
    limit = section.graph_max_tokens
    if section.graphs and limit and step_tokens > limit:
        return f"eager: {step_tokens} tokens per batch > dense.graph_max_tokens {limit}"
    return ""


class DenseTraining:
    """Forward (autocast), backward's exposed all-reduce, the guarded step."""

    def __init__(
        self,
        model: nn.Module,
        section: DenseSection,
        faults: FaultsSection,
        guard: Any,
        device: torch.device,
        timer: SectionTimer,
        step_tokens: int = 0,
        run: RunSection | None = None,
    ) -> None:
        """``step_tokens``: the most UIH tokens of a local batch (batch_size x max_uih);
        ``run``: its steps end an lr schedule, its seed keys dropout's masks."""
        run = run or RunSection()
        self.seed = run.seed
        self.model, self.guard, self.device, self.timer = model, guard, device, timer
        check_attention_device(model, device)  # model.attention=cudnn: this GPU, at start
        world = dist.get_world_size()
        self.graphs: BlockGraphs | None = None
        self.graphs_skipped = graphs_skipped(section, step_tokens)
        if section.graphs and not self.graphs_skipped:
            # The same parameters in the same order (the gradient sum's buckets
            # do not change). One rank: no hook waits, the graphs set `.grad`.
            self.graphs = install_graphs(model, section.graph_streams == 2, world == 1)
        # Graphs that run replay the blocks' eager path methods: compile would not
        # apply there, so it is off and the summary says so (`compile_state`).
        self.compile_asked = section.compile
        if section.compile and self.graphs is None:
            compile_regions(model)
        # Frames dynamo compiled from this step's forward to its optimizer step
        # (an evaluation's compiles between steps are no step's)
        self.step_frames, self._frames_before = 0, 0
        self.step_graphs, self._graphs_before = 0, 0  # cuDNN attention graphs built
        self.sync = DenseSync(model, timer.seq_mark)
        # Listed once: `Module.parameters()` walks the module tree on every call.
        self.params = list(model.parameters())
        self.optimizer = GuardedAdam(self.params, section.lr, section.weight_decay)
        self.lr_schedule = lr_schedule(section.lr, section.lr_warmup, section.lr_decay, run.steps)
        self.nonfinite = NonFiniteCount(faults.nonfinite, faults.nonfinite_max_skips)
        self.autocast = torch.autocast(
            device.type, dtype=torch.bfloat16, enabled=section.amp == "bf16"
        )

    def attention_summary(self) -> dict[str, Any]:
        """The summary's ``attention``: what the model's block stack runs here."""
        found = attention_in_use(self.model, self.device)
        return {"attention": found} if found else {}

    def graph_summary(self) -> dict[str, Any]:
        """The summary's word on ``dense.graphs`` and ``dense.compile``: nothing
        for one not asked for; ``dense_compile`` says whether it ran."""
        out = {}
        if self.compile_asked:
            out["dense_compile"] = compile_state(True, self.graphs is not None)
        if self.graphs is not None:  # captures after warm-up cost step time
            return {**out, "dense_graphs": "on", "dense_graphs_captured": self.graphs.captures}
        return {**out, "dense_graphs": self.graphs_skipped} if self.graphs_skipped else out

    def forward(self, batch: Any, step: int = 0) -> Tensor:
        """The logits of training step ``step`` (dropout's masks are that step's)."""
        self._frames_before = compiled_frames()
        self._graphs_before = cudnn_sdpa.CACHE.builds
        self.sync.share_buffers()
        with self.autocast, training_step(self.model, self.seed, step):
            return self.model(batch)

    def backward(self, loss: Tensor, empty: bool) -> None:
        """Backward of ``loss`` (the sparse update inside it); ``empty``: some
        part of the local batch is empty (every rank must reduce every bucket)."""
        if empty:
            loss = self.sync.cover_all(loss)
        self.guard.begin_step(loss)
        self.sync.arm()
        loss.backward()  # fused sparse update (skipped if any rank saw a non-finite) + dense
        self.sync.finish()
        if self.sync.last_ready is not None:
            # Exposed dense all-reduce: from the later of "last bucket ready" and
            # "embedding backward done" (its own sections) to the end of backward.
            last = self.timer.last_end or (0, None)
            start = max(self.sync.last_ready, last, key=lambda m: m[0])[1]
            self.timer.add_interval("dense_allreduce", start, self.timer.mark())

    def step(self, step: int = 0) -> Tensor:
        """The optimizer step of run step ``step``, skipped on a non-finite; the
        flags of `skip_flags`."""
        flags = skip_flags(self.guard, self.params, self.device)
        if self.lr_schedule is not None:
            self.optimizer.set_lr(self.lr_schedule(step + 1))
        self.optimizer.step_unless(flags[0].float())
        self.optimizer.zero_grad(set_to_none=True)
        self.step_frames = compiled_frames() - self._frames_before
        self.step_graphs = cudnn_sdpa.CACHE.builds - self._graphs_before
        return flags
