"""Regional ``torch.compile`` of a model's blocks (``dense.compile=true``).

**What is compiled.** The modules a model names in ``compile_regions``
(`freescale.models.contract`), each in place with its own ``nn.Module.compile``;
a path naming an ``nn.ModuleList`` compiles each child, one region per block,
the way torchtitan compiles per transformer block. In place: parameters, state
dict and module tree are unchanged (checkpoints load either way, the gradient
sum's buckets and the sharded tables see the same parameters and modules).
Per block rather than the whole model:
identical blocks are one code object whose guards pass for every instance (the
parameters are inputs of the graph), so one compile serves all layers, and
nothing outside the blocks (the embedding exchange, the loss, the guard) is
traced. A region's calls that dynamo should not trace are the model's to mark
(`blocks.Block.compile` leaves its attention out: a graph break per call;
HSTU's padded attention is plain torch and traces with the rest).

**Dynamic token dimension.** ``dynamic=True``: every size of a region's inputs
is symbolic from the first compile, so a new batch (other token counts, other
maxima) reuses the compiled code instead of recompiling. Two of torch's shape
defaults would still specialize on jagged sizes, and `compile_regions` sets
them for the process (the rank's own):

- *duck sizing* (``torch.fx.experimental._config.use_duck_shape``) off: two
  sizes equal by chance when a graph is traced (a batch of 32 tokens and a
  head dim of 32) would otherwise become one symbol, and the next batch a
  recompile;
- sizes 0 and 1 stay specialized (torch's rule; making them size-oblivious
  breaks broadcasting of size-1 dims): a batch whose rows of some input
  number 0 or 1 (an empty rank, a single candidate) compiles its own graph
  once, and the counter shows it.

**Counting.** `compiled_frames` reads dynamo's count of compiled frames (first
compiles, recompiles and the resume frames after graph breaks alike); the
trainer logs its increase over each training step (``compiled_frames`` in the
step JSON) and the summary its sum over the measured steps: 0 after warm-up
is the claim the tests and the ``mfu`` scenario check.

**Weights.** Under bf16 autocast a compiled region casts each fp32 weight to
bf16 once per forward (inside the graph, saved for the backward), as eager
autocast does; they are KB–MB against the activations' hundreds of MB, and
keeping bf16 copies updated by the optimizer is not done here.
"""

from __future__ import annotations

import sys

from torch import nn


def regions(model: nn.Module) -> list[nn.Module]:
    """The modules ``model``'s ``compile_regions`` name (a ModuleList: its
    children); one-line ValueError when it names none or a missing path."""
    paths = getattr(model, "compile_regions", ())
    if isinstance(paths, str) or not isinstance(paths, (tuple, list)) or not paths:
        raise ValueError(
            "dense.compile=true needs a model that names its compile_regions (module "
            "paths, freescale.models.contract); this model names none"
        )
    found: list[nn.Module] = []
    for path in paths:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"compile_regions: {path!r} is not a submodule of the model") from None
        found += list(module) if isinstance(module, nn.ModuleList) else [module]
    return found


def compile_regions(model: nn.Module, dynamic: bool = True, backend: str = "inductor") -> int:
    """Compile each region of ``model`` in place (see the module docstring);
    the number of regions. ``dynamic=False`` (a static token dimension) and
    ``backend`` are for tests: the counter must see the recompiles of the one
    and the numbers of the other must match eager."""
    import torch.fx.experimental._config as shapes

    shapes.use_duck_shape = False
    found = regions(model)
    for module in found:
        module.compile(dynamic=dynamic, backend=backend)
    return len(found)


def compiled_frames() -> int:
    """Frames dynamo has compiled in this process so far (0 before it is ever
    imported: reading the count never imports it)."""
    if "torch._dynamo" not in sys.modules:
        return 0
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def compile_state(asked: bool, graphs_on: bool) -> str:
    """The summary's word on ``dense.compile``: ``on``, or why it did not run."""
    if not asked:
        return "off"
    if graphs_on:
        return (
            "off: dense.graphs=true replays CUDA graphs of the block stack, which run "
            "the blocks' eager path methods (the two do not compose)"
        )
    return "on"
