"""Exported programs score as the training model's eval forward does.

For the built-in sequence model, ``hstu`` and the user model of
examples/categories.py: one export (traced once, every jagged dimension
dynamic) serves random batches of every shape — one sample, empty histories,
no candidates, one candidate, many — and its scores equal the eval forward's:
bitwise where the program runs the model's own kernels (the sequence model's
attention op, ``hstu``'s padded attention, the categories model), within the
reordered-sum tolerance where it runs the padded attention instead of the
per-sample reference (the sequence model exported ``attention="padded"``;
bitwise to the same model run padded eagerly). The default selection checks a
few batches; the slow one 200, and the AOTInductor package.
"""

import json

import pytest
import torch

from examples.categories import build as build_categories
from freescale.jagged.batch import SampleBatch
from freescale.jagged.schema import DataSchema, Feature
from freescale.jagged.tensor import JaggedFeatures
from freescale.models import hstu, sequence
from freescale.serving import ExportError, export_model, load
from freescale.serving.signature import program_widths
from freescale.testing.batches import random_batch
from freescale.testing.tolerance import assert_reordered_close

DIM, LAYERS, ITEMS = 16, 2, 100
CATEGORIES = 7


def _with_categories(batch: SampleBatch) -> SampleBatch:
    batch.uih.features["category"] = batch.uih["item_ids"] % CATEGORIES
    batch.candidates.features["category"] = batch.candidates["item_ids"] % CATEGORIES
    return batch


MODELS = {
    "sequence": (
        lambda: sequence.build(DataSchema.standard(ITEMS, 4, dense_dim=2), dim=DIM, layers=LAYERS),
        2,
    ),
    "sequence-padded": (
        lambda: sequence.build(DataSchema.standard(ITEMS, 4, dense_dim=2), dim=DIM, layers=LAYERS),
        2,
    ),
    "hstu": (
        lambda: hstu.build(DataSchema.standard(ITEMS, 4, dense_dim=2), dim=DIM, layers=LAYERS),
        2,
    ),
    "categories": (
        lambda: build_categories(
            DataSchema.standard(
                ITEMS,
                4,
                (Feature("category", "uih", CATEGORIES), Feature("category", "candidates", 7)),
            ),
            dim=DIM,
        ),
        None,
    ),
}


def _lonely(dense_dim: int | None) -> SampleBatch:
    """One sample: an empty history, one candidate without content."""
    z = torch.zeros(0, dtype=torch.int64)
    return SampleBatch(
        uih=JaggedFeatures(torch.tensor([0, 0]), {"item_ids": z, "actions": z, "timestamps": z}),
        candidates=JaggedFeatures(torch.tensor([0, 1]), {"item_ids": torch.tensor([3])}),
        labels=torch.zeros(1),
        content=JaggedFeatures(torch.tensor([0, 0]), {"content_ids": z}),
        sample_id=torch.tensor([0]),
        dense=None if dense_dim is None else torch.randn(1, dense_dim),
    )


def batches(name: str, count: int, seed: int = 1) -> list[SampleBatch]:
    """``count`` batches of varied shapes (the first: `_lonely`)."""
    dense = MODELS[name][1]
    out = [_lonely(dense)]
    for i in range(count - 1):
        b = random_batch(
            seed + i,
            batch_size=(1, 2, 3, 7, 16)[i % 5],
            max_uih=(0, 1, 6, 30)[i // 5 % 4],
            max_candidates=(1, 1, 5)[i % 3],
            num_items=ITEMS,
            dense_dim=dense,
        )
        out.append(b)
    return [_with_categories(b) if name == "categories" else b for b in out]


def example(name: str) -> SampleBatch:
    """The batch exports are traced on: 16 samples, every size at least 2."""
    b = random_batch(100, 16, max_uih=30, max_candidates=5, num_items=ITEMS,
                     dense_dim=MODELS[name][1])  # fmt: skip
    return _with_categories(b) if name == "categories" else b


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``name -> (the eval-mode model, its served export)``, exported once each."""
    cache = {}

    def get(name: str):
        if name not in cache:
            torch.manual_seed(0)
            model = MODELS[name][0]().eval()
            attention = "padded" if name.endswith("-padded") else "jagged"
            out = export_model(model, example(name), tmp_path_factory.mktemp(name),
                               attention=attention)  # fmt: skip
            cache[name] = (model, load(out), out)
        return cache[name]

    return get


def _check(name: str, model, served, count: int) -> None:
    """Bitwise where the program runs the eval forward's kernels: the
    categories model and the sequence model's attention op always; the padded
    attentions at the program's widths
    (at least 2: a longest history or candidate count of 0 or 1 is padded to
    2, where BLAS takes another kernel). Else within the reordered-sum bound."""
    for batch in batches(name, count):
        with torch.no_grad():
            expected = model(batch)
        got = served(batch)
        assert got.shape == expected.shape == batch.labels.shape
        if name in ("categories", "sequence"):
            assert torch.equal(got, expected)
            continue
        assert_reordered_close(got, expected, terms=4 * DIM, depth=LAYERS + 1)
        same = batch.with_max_lengths(*program_widths(batch))
        padded = name == "sequence-padded"
        if padded:
            model.blocks.padded = True  # the program's attention, eagerly
        with torch.no_grad():
            assert torch.equal(got, model(same))
        if padded:
            model.blocks.padded = False


@pytest.mark.parametrize("name", list(MODELS))
def test_one_export_scores_every_batch_shape_as_the_eval_forward(exported, name):
    model, served, _ = exported(name)
    _check(name, model, served, 12)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_200_random_batches(exported, name):
    model, served, _ = exported(name)
    _check(name, model, served, 200)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_the_aoti_package_on_cpu(exported, name, tmp_path):
    """Inductor fuses and reorders: within the reordered-sum tolerance."""
    torch.manual_seed(0)
    model = MODELS[name][0]().eval()
    attention = "padded" if name.endswith("-padded") else "jagged"
    served = load(export_model(model, example(name), tmp_path, aoti=True, attention=attention))
    assert served.kind == "aoti"
    for batch in batches(name, 200):
        with torch.no_grad():
            expected = model(batch)
        assert_reordered_close(served(batch), expected, terms=4 * DIM, depth=LAYERS + 1)


def test_the_flat_signature_is_the_batch_s(exported):
    _, served, out = exported("categories")
    batch = batches("categories", 3)[2]
    flat = served.flatten(batch)
    assert torch.equal(served(*flat), served(batch))
    with pytest.raises(ValueError, match="must be int64"):
        served(*(t.int() if i == 0 else t for i, t in enumerate(flat)))
    program = torch.export.load(out / "model.pt2").module()  # plain torch serves it too
    assert torch.equal(program(*flat), served(batch))


class _HostBranch(torch.nn.Module):
    """Branches on a tensor's value on the host: not one program."""

    sharded_modules = ()

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(1, 1)

    def embedding_inputs(self, batch):
        return {}

    def forward(self, batch):
        scores = self.inner(batch.candidates["item_ids"][:, None].float()).squeeze(-1)
        if batch.uih.offsets.max() > 3:  # a branch on a value: no single program
            scores = scores + 1
        return scores


def test_a_model_that_cannot_be_exported_is_one_paragraph(tmp_path):
    with pytest.raises(ExportError) as info:
        export_model(_HostBranch(), example("hstu"), tmp_path)
    text = str(info.value)
    assert "\n" not in text and len(text) < 1200
    assert text.startswith("_HostBranch cannot be exported in module (the model) (")
    assert "test_export.py" in text and "forward" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("amp", ["none", "bf16"])
def test_the_attention_op_serves_on_cuda(amp, tmp_path):
    """On CUDA the op runs the eval forward's kernels (cuDNN or varlen in bf16,
    the Triton cross-attention), each call on its own layout; bf16 kernels may
    pick other tiles for other sizes: within bf16's reordered-sum bound (with
    ``amp="bf16"``, of the forward under the same autocast)."""
    from freescale.testing.tolerance import reduction_tol

    torch.manual_seed(0)
    model = MODELS["sequence"][0]().cuda().eval()
    served = load(export_model(model, example("sequence"), tmp_path, device="cuda", amp=amp))
    tol = reduction_tol(torch.bfloat16, 4 * DIM, 1.0, LAYERS + 1)
    for batch in batches("sequence", 20):
        batch = batch.to("cuda")
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16, enabled=amp == "bf16"):
            expected = model(batch).float()
        diff = (served(batch) - expected).abs().max().item() if expected.numel() else 0.0
        assert diff <= tol["atol"] + tol["rtol"], diff


def test_an_unknown_exported_attention_is_one_line(tmp_path):
    model = MODELS["sequence"][0]().eval()
    with pytest.raises(
        ValueError, match="exported attention must be jagged or padded, got 'dense'"
    ):
        export_model(model, example("sequence"), tmp_path, attention="dense")


@pytest.mark.parametrize("name", ["sequence", "hstu"])
def test_a_bf16_program_scores_as_the_forward_under_autocast(name, tmp_path):
    """``amp="bf16"``: the program runs the forward under bf16 autocast (as
    training with ``dense.amp=bf16`` does): within bf16's reordered-sum bound
    of the eager forward under the same autocast, float32 out, and not the
    float32 forward's scores (the autocast is in the program)."""
    from freescale.testing.tolerance import reduction_tol

    torch.manual_seed(0)
    model = MODELS[name][0]().eval()
    served = load(export_model(model, example(name), tmp_path, amp="bf16"))
    tol = reduction_tol(torch.bfloat16, 4 * DIM, 1.0, LAYERS + 1)
    moved = False
    for batch in batches(name, 12)[1:]:
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            expected = model(batch).float()
        with torch.no_grad():
            plain = model(batch)
        got = served(batch)
        assert got.dtype == torch.float32
        assert (got - expected).abs().max().item() <= tol["atol"] + tol["rtol"]
        moved |= not torch.equal(got, plain)
    assert moved
    assert json.loads((tmp_path / "manifest.json").read_text())["amp"] == "bf16"


def test_amp_follows_the_run_on_cuda_only():
    from freescale.config import build_config
    from freescale.serving.exporter import run_amp

    bf16 = build_config("h200-21k")
    assert bf16.dense.amp == "bf16"
    assert run_amp("auto", bf16, "cuda") == "bf16"
    assert run_amp("auto", bf16, "cpu") == "none"  # dense.amp is CUDA's only
    assert run_amp("auto", build_config("demo"), "cuda") == "none"
    assert run_amp("bf16", build_config("demo"), "cpu") == "bf16"
    with pytest.raises(ValueError, match="amp must be auto, none or bf16; got 'fp8'"):
        run_amp("fp8", bf16, "cuda")


@pytest.mark.slow
def test_the_aoti_package_holds_code_not_a_second_copy_of_the_tables(tmp_path):
    """The package reads the program's weights (10M-row tables did not load from
    a package that embedded them): it stays small beside a large table."""
    torch.manual_seed(0)
    model = sequence.build(DataSchema.standard(200_000, 4, dense_dim=2), dim=DIM, layers=1).eval()
    out = export_model(model, example("sequence"), tmp_path, aoti=True)
    table_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert (out / "model_aoti.pt2").stat().st_size < table_bytes / 4
    served = load(out)
    assert served.kind == "aoti"
    for batch in batches("sequence", 5):
        with torch.no_grad():
            expected = model(batch)
        assert_reordered_close(served(batch), expected, terms=4 * DIM, depth=2)
