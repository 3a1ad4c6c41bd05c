"""``dense.compile``: regional torch.compile of the model's blocks (`pipeline/compile.py`).

- numbers: a compiled copy of a tiny model against its eager twin, logits and
  every parameter gradient, within the reordered-sum tolerance of
  `freescale.testing.tolerance` (fast twin: AOTAutograd's graphs run by torch
  ops, ``aot_eager``; Inductor's fused kernels in the slow test);
- recompiles: after warm-up, many steps of jagged batches of other sizes
  compile nothing; the same harness with the token dimension static
  (``dynamic=False``) counts recompiles, so the counter can see them;
- the trainer: the step JSON's ``compiled_frames`` and the summary's
  ``dense_compile`` (CPU, slow; GPU with the graphs' composition);
- the config key and the contract's one-line errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.fx.experimental._config as shapes
from torch import nn

from freescale.config import DenseSection, build_config
from freescale.jagged.batch import UIH_IDS
from freescale.models.hstu import HSTUConfig, HSTUModel
from freescale.models.sequence import ModelConfig, SequenceModel
from freescale.pipeline.compile import compile_regions, compile_state, compiled_frames, regions
from freescale.testing.batches import random_batch
from freescale.testing.tolerance import assert_reordered_close

DIM, HEADS, LAYERS, RATIO = 16, 2, 2, 2
# Chained reductions of one block's forward: norm, qkv, attention (scores,
# then values), proj, norm, the MLP's two layers; the backward as many again.
BLOCK_DEPTH = 8


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts with no compiled code (the blocks' code objects are
    shared by every model) and leaves torch's shape defaults as it found them."""
    import torch._dynamo

    duck = shapes.use_duck_shape
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    shapes.use_duck_shape = duck


def _sequence(layers: int = LAYERS) -> SequenceModel:
    torch.manual_seed(0)
    return SequenceModel(ModelConfig(num_items=100, dim=DIM, heads=HEADS, layers=layers))


def _hstu() -> HSTUModel:
    torch.manual_seed(0)
    return HSTUModel(HSTUConfig(num_items=100, dim=DIM, heads=HEADS, layers=LAYERS))


def _batches(count: int, first_seed: int = 0, max_uih: int = 12):
    """Jagged batches of varying sizes with >= 2 history and >= 2 candidate rows,
    a sample with >= 2 of each (HSTU's padded widths) and one holding both:
    dynamo specializes sizes 0 and 1, and a cross-attention without any key has
    no gradient; such batches compile their own graphs, once."""
    seed = first_seed
    while count:
        b = random_batch(seed, 2 + seed % 5, max_uih=3 + seed % max_uih, max_candidates=3)
        seed += 1
        uih, cands = b.uih_lengths(), b.num_candidates()
        if min(uih.max(), cands.max()) >= 2 and bool(((uih > 0) & (cands > 0)).any()):
            count -= 1
            yield b


def _step(model: nn.Module, batch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(batch)
    (logits * torch.linspace(-1, 1, logits.numel())).sum().backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]
    return logits.detach(), [g.detach().clone() for g in grads]


def _assert_twins(model: nn.Module, backend: str, steps: int) -> None:
    """The compiled copy's logits and gradients against the eager model's."""
    compiled = copy.deepcopy(model)
    assert compile_regions(compiled, backend=backend) == LAYERS
    for batch in _batches(steps):
        (want, want_g), (got, got_g) = _step(model, batch), _step(compiled, batch)
        tokens = batch.uih[UIH_IDS].numel() + batch.num_candidates_total
        terms = max(RATIO * DIM, tokens)  # the longest sum: a hidden dim, or a weight's
        # gradient over the tokens (and the attention's over a sample's keys, fewer)
        assert_reordered_close(got, want, terms=terms, depth=BLOCK_DEPTH * LAYERS + 2)
        for g, w in zip(got_g, want_g, strict=True):
            assert_reordered_close(g, w, terms=terms, depth=2 * BLOCK_DEPTH * LAYERS + 2)


def test_compiled_blocks_match_eager_aot_graphs():
    """The fast twin: AOTAutograd's forward and backward graphs (decomposed,
    so reordered), run by torch ops."""
    _assert_twins(_sequence(), "aot_eager", steps=2)


@pytest.mark.slow
@pytest.mark.parametrize("make", [_sequence, _hstu], ids=["sequence", "hstu"])
def test_compiled_blocks_match_eager_inductor(make):
    """Inductor's fused CPU kernels (C++), forward and backward."""
    _assert_twins(make(), "inductor", steps=2)


def _recompiles(model: nn.Module, dynamic: bool, steps: int, backend: str = "eager") -> int:
    """Frames compiled over ``steps`` batches after a warm-up of two (the
    last block's variant without its history update is compiled in the first)."""
    compile_regions(model, dynamic=dynamic, backend=backend)
    batches = list(_batches(steps + 2, first_seed=100))
    for batch in batches[:2]:
        model(batch).sum().backward()
    before = compiled_frames()
    for batch in batches[2:]:
        model(batch).sum().backward()
    return compiled_frames() - before


def test_no_recompile_over_jagged_batches_with_a_dynamic_token_dimension():
    assert _recompiles(_sequence(), dynamic=True, steps=16) == 0


def test_the_counter_sees_recompiles_of_a_static_token_dimension():
    """The same harness, token dimension static: new sizes recompile, and the
    count says so (if it read 0 here, 0 above would prove nothing)."""
    assert _recompiles(_sequence(), dynamic=False, steps=2) > 0


@pytest.mark.slow
def test_no_recompile_of_inductor_graphs_or_hstu_layers():
    """Inductor adds no guard of its own; HSTU's padded attention (traced,
    no graph break) stays dynamic too; both fail static."""
    assert _recompiles(_sequence(), dynamic=True, steps=12, backend="inductor") == 0
    assert _recompiles(_hstu(), dynamic=True, steps=24) == 0
    assert _recompiles(_hstu(), dynamic=False, steps=4) > 0


def test_reading_the_counter_imports_nothing():
    import subprocess
    import sys

    code = ("import sys; from freescale.pipeline.compile import compiled_frames; "
            "assert compiled_frames() == 0; assert 'torch._dynamo' not in sys.modules")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- the config key, the contract, the summary's word --------------------------
def test_config_key_defaults_off_and_validates():
    assert build_config("demo", []).dense.compile is False
    assert build_config("h200-21k", []).dense.compile is False
    assert build_config("demo", ["dense.compile=true"]).dense.compile is True
    with pytest.raises(ValueError, match=r"^dense\.compile expects a bool, got 'maybe'$"):
        build_config("demo", ["dense.compile=maybe"])
    with pytest.raises(ValueError, match=r"^dense\.compile must be true or false, got 'yes'$"):
        DenseSection(compile="yes")  # type: ignore[arg-type]


def test_regions_come_from_the_model_contract():
    assert len(regions(_sequence(layers=3))) == 3  # a ModuleList: one region per block
    assert len(regions(_hstu())) == LAYERS

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(2, 2)

    with pytest.raises(ValueError, match=r"^dense\.compile=true needs a model that names its"):
        regions(Plain())
    named = Plain()
    named.compile_regions = ("body",)  # type: ignore[assignment]
    assert regions(named) == [named.body]
    named.compile_regions = ("nothing",)  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"^compile_regions: 'nothing' is not a submodule"):
        regions(named)


def test_compiling_keeps_the_module_tree_and_state_dict():
    model = _sequence()
    keys = list(model.state_dict())
    compile_regions(model, backend="eager")
    assert list(model.state_dict()) == keys
    assert all(type(b).__name__ == "Block" for b in model.blocks)


def test_summary_says_which_ran():
    assert compile_state(False, False) == "off"
    assert compile_state(True, False) == "on"
    assert compile_state(True, True).startswith("off: dense.graphs=true replays CUDA graphs")


# ---- the trainer ---------------------------------------------------------------
def _train(device: str, extra: list[str]):
    import freescale

    sets = [f"run.device={device}", "run.nproc=1", "run.steps=10", "run.warmup=3",
            "run.batch_size=4", "data.max_uih=48", "data.num_items=500", "model.layers=2",
            "data.loader_workers=0", "evaluation.every=0", "output.progress=false",
            *extra]  # fmt: skip
    return freescale.train(config=build_config("demo", sets))


@pytest.mark.slow
def test_trainer_compiles_once_and_tracks_eager_on_cpu():
    compiled, eager = _train("cpu", ["dense.compile=true"]), _train("cpu", [])
    assert compiled.summary["dense_compile"] == "on" and "dense_compile" not in eager.summary
    frames = [s["compiled_frames"] for s in compiled.steps]
    assert frames[0] > 0 and sum(frames[1:]) == 0
    assert compiled.summary["compiled_frames_after_warmup"] == 0
    assert all(s["compiled_frames"] == 0 for s in eager.steps)
    for a, b in zip(compiled.steps, eager.steps, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-3  # 10 steps of Adam: see the numbers tests


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_trainer_compiles_once_on_gpu_and_graphs_say_which_ran():
    amp = ["dense.amp=bf16"]
    compiled = _train("cuda", ["dense.compile=true", *amp])
    eager = _train("cuda", amp)
    assert compiled.summary["dense_compile"] == "on"
    assert sum(s["compiled_frames"] for s in compiled.steps[1:]) == 0
    for a, b in zip(compiled.steps, eager.steps, strict=True):
        assert abs(a["loss"] - b["loss"]) < 2e-2  # bf16 autocast, 10 Adam steps
    both = _train("cuda", ["dense.compile=true", "dense.graphs=true", *amp])
    assert both.summary["dense_graphs"] == "on"
    assert both.summary["dense_compile"].startswith("off: dense.graphs=true")
    assert all(s["compiled_frames"] == 0 for s in both.steps)


def test_steps_count_the_attention_graphs_they_build(monkeypatch):
    """A cuDNN graph built inside a step (here: the cache's counter bumped by
    step 6's forward) shows in that step's JSON and in the summary."""
    from freescale.kernels.attention import cudnn_sdpa
    from freescale.models.blocks import BlockStack

    forward, calls = BlockStack.forward, []

    def counting(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 7:  # step 6 (one forward per step)
            cudnn_sdpa.CACHE.builds += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(BlockStack, "forward", counting)
    run = _train("cpu", [])
    assert len(calls) == 10
    built = [s["attention_graphs_built"] for s in run.steps]
    assert built == [0] * 6 + [1] + [0] * 3
    assert run.summary["attention_graphs_after_warmup"] == 1
    # and which attention ran (on a GPU: cuDNN, or why not)
    assert run.summary["attention"] == {"self": "reference", "cross": "reference"}
