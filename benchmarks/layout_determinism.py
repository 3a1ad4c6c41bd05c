"""Is the per-forward attention layout bit-identical to the old forward on CUDA?

Runs the model's forward (new) and the pinned pre-change forward
(tests/models/test_layout_once.py) twice each per batch spec and prints the
largest logit difference of every pair. ``--deterministic`` turns on
``torch.use_deterministic_algorithms`` (what ``deterministic=true`` does in
training): without it the content pooling's ``index_add`` (atomics) can make
two runs of the *same* forward differ.

    PYTHONPATH=$PWD python3 benchmarks/layout_determinism.py [--deterministic] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch

from freescale.models import ModelConfig, SequenceModel
from tests.models.test_layout_once import BATCHES, _batch, _run, pinned_forward


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--repeat", type=int, default=1)
    args = p.parse_args()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    for i, spec in enumerate(BATCHES * args.repeat):
        cfg = ModelConfig(num_items=100, dim=64, heads=2, layers=3, dense_dim=2, attention="auto")
        torch.manual_seed(0)
        m = SequenceModel(cfg).cuda()
        batch = _batch(spec).to("cuda")
        runs = {
            "new1": _run(m, m, batch),
            "new2": _run(m, m, batch),
            "old1": _run(m, partial(pinned_forward, m), batch),
            "old2": _run(m, partial(pinned_forward, m), batch),
        }
        pairs = (("new1", "new2"), ("old1", "old2"), ("new1", "old1"), ("new2", "old2"))
        print(i, "  ".join(f"{a}-{b} {_diff(runs[a][0], runs[b][0]):.3g}" for a, b in pairs))


def _diff(x: torch.Tensor, y: torch.Tensor) -> float:
    return (x - y).abs().amax().item() if x.numel() else 0.0


if __name__ == "__main__":
    main()
