"""Run-to-run determinism of the model's forward on CUDA (was
benchmarks/layout_determinism.py; the old-vs-new layout half is
tests/models/test_layout_once.py::test_flash_path_unchanged_on_gpu).

With deterministic algorithms (what ``deterministic=true`` turns on in
training) two forwards of the same model on the same batch give bit-identical
logits; measured on an H200 at c41bfaa: every pair 0.0 over 3 repeats."""

from __future__ import annotations

import pytest
import torch

from freescale.models import ModelConfig, SequenceModel
from tests.models.test_layout_once import BATCHES, _batch, _run


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("spec", BATCHES)
@pytest.mark.parametrize("attention", ["varlen", "auto"])  # auto: cuDNN's where it runs
def test_forward_is_deterministic_on_gpu(spec, attention, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        cfg = ModelConfig(
            num_items=100, dim=64, heads=2, layers=3, dense_dim=2, attention=attention
        )
        torch.manual_seed(0)
        m = SequenceModel(cfg).cuda()
        batch = _batch(spec).to("cuda")
        first, second = _run(m, m, batch), _run(m, m, batch)
        assert torch.equal(first[0], second[0])
    finally:
        torch.use_deterministic_algorithms(previous)
