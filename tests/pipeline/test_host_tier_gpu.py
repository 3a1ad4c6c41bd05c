"""The host tier on one GPU: bit-identical to the device placement.

On CUDA the tier's rows are pinned host memory read and written in place by
GPU kernels, gathers staged on a side stream: every mode x optimizer at W=1
must give the losses, table, optimizer state and dense weights of the same run
with the table in GPU memory. Skipped without CUDA (the CPU twin's contract is
tests/pipeline/test_host_tier_train.py).
"""

import pytest
import torch

from freescale.testing import run_ranks
from tests.pipeline.test_host_tier_train import HOST
from tests.pipeline.test_train import _train_and_collect, assert_same_run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# loader_workers=0: the harness's rank is a daemon process (no children)
COMMON = ["run.device=cuda", "run.deterministic=true", "run.steps=12", "run.warmup=1",
          "evaluation.every=6", "evaluation.batches=1", "data.loader_workers=0"]  # fmt: skip


def _on_cpu(overrides: list[str]) -> dict:
    got = _train_and_collect(overrides)
    move = {k: v.cpu() for k, v in got["opt_state"].items()}
    dense = {k: v.cpu() for k, v in got["dense"].items()}
    return {**got, "table": got["table"].cpu(), "opt_state": move, "dense": dense}


@pytest.mark.parametrize("mode", ["sync", "sdd", "freescale"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_a_host_table_on_a_gpu_trains_as_a_device_table(mode, optimizer):
    extra = [*COMMON, f"run.mode={mode}", f"embeddings.optimizer={optimizer}"]
    if mode == "freescale":
        extra.append("pipeline.prioritize=on")  # the collision split at one rank too
    device = run_ranks(_on_cpu, 1, extra, timeout=240)[0]
    host = run_ranks(_on_cpu, 1, [*extra, HOST], timeout=240)[0]
    assert_same_run(device, host)
