"""MFU's inputs: the peak table, which models count FLOPs, and counting them on the host."""

import pytest
import torch
from torch import nn

from freescale.models import ModelConfig, SequenceModel
from freescale.models.contract import RecModel
from freescale.models.hstu import HSTUConfig, HSTUModel
from freescale.observe.flops import model_flops, peak_tflops, sized_batch, table_peak
from freescale.pipeline.loader import BatchInfo
from freescale.testing.batches import random_batch


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),  # SXM
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H200 NVL", 835.0),
        ("NVIDIA GH200 480GB", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA L40S", 362.0),
        ("NVIDIA L40", 181.0),
        ("NVIDIA L4", 121.0),
        ("NVIDIA A10", 125.0),
        # not in the table: no peak, never a neighbour's
        ("NVIDIA A10G", None),
        ("Tesla V100-SXM2-16GB", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("", None),
    ],
)
def test_peak_table_matches_whole_words(name, peak):
    assert table_peak(name) == peak


def test_peak_is_none_on_cpu_unless_given():
    cpu = torch.device("cpu")
    assert peak_tflops(cpu) is None
    assert peak_tflops(cpu, 0.0) is None
    assert peak_tflops(cpu, 400.0) == 400.0  # the override wins on any device


class _NoFlops(nn.Module):
    sharded_modules = ()


class _DefaultFlops(RecModel):
    pass


def test_only_models_that_count_give_a_count():
    assert model_flops(_NoFlops()) is None  # duck-typed model without flops
    assert model_flops(_DefaultFlops()) is None  # the contract's default knows nothing
    assert model_flops(None) is None
    m = SequenceModel(ModelConfig(num_items=50, dim=8, heads=2, layers=1))
    assert model_flops(m) == m.flops


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", ["sequence", "hstu"])
def test_a_batch_of_the_same_sizes_has_the_same_flops(seed, kind):
    """What the balancer counts: the model on a zero batch of the balanced sizes."""
    if kind == "sequence":
        m = SequenceModel(ModelConfig(num_items=100, dim=16, heads=2, layers=2, dense_dim=2))
    else:
        m = HSTUModel(HSTUConfig(num_items=100, dim=16, heads=2, layers=2, dense_dim=2))
    batch = random_batch(seed, 7, max_uih=9, max_candidates=3, max_content=2)
    sized = sized_batch(
        batch, batch.uih_lengths(), batch.num_candidates(), batch.candidate_lengths()
    )
    assert sized.uih.offsets.tolist() == batch.uih.offsets.tolist()
    assert sized.content.offsets.tolist() == batch.content.offsets.tolist()
    assert all(t.shape == u.shape for t, u in zip(sized.tensors(), batch.tensors(), strict=True))
    assert m.flops(sized) == m.flops(batch) > 0
    empty = torch.zeros(0, dtype=torch.int64)
    none = sized_batch(batch, empty, empty, empty)  # a rank left without samples
    assert none.batch_size == 0 and m.flops(none) == 0


def test_batch_info_carries_the_count():
    m = SequenceModel(ModelConfig(num_items=100, dim=16, heads=2, layers=2, dense_dim=2))
    batch = random_batch(3, 5)
    assert BatchInfo.of(batch, flops=model_flops(m)).flops == m.flops(batch)
    assert BatchInfo.of(batch).flops is None
    assert isinstance(BatchInfo.of(batch, flops=lambda b: 12).flops, float)
