"""Loader workers building runs of consecutive steps (`StepBatches` ``group``,
a streamed source's ``steps_per_read``) hand out the same batches, in step
order, as one step per item and as no worker at all."""

import pytest
import torch

from freescale.data import SyntheticConfig, SyntheticSource
from freescale.pipeline.loader import Prefetcher, StepBatches, steps_per_read


class Grouped:
    """A synthetic source that asks for ``per_read`` steps per worker item."""

    def __init__(self, per_read: int) -> None:
        self.inner = SyntheticSource(SyntheticConfig(num_items=300, max_uih=24, seed=5))
        self.num_items, self.num_actions = self.inner.num_items, self.inner.num_actions
        self.per_read = per_read

    def batch(self, step, rank, world_size, batch_size):
        return self.inner.batch(step, rank, world_size, batch_size)

    def num_steps(self, world_size, batch_size):
        return None

    def steps_per_read(self, batch_size):
        return self.per_read


def _ids(source, workers, steps):
    loader = Prefetcher(source, 1, 2, 4, torch.device("cpu"), steps, workers=workers)
    out = []
    try:
        while True:
            batch, info = loader.get()
            out.append((batch.sample_id.tolist(), info.samples))
    except StopIteration:
        pass
    loader.close()
    return out


@pytest.mark.parametrize("per_read", [1, 3, 16])
def test_groups_of_steps_give_the_batches_in_step_order(per_read):
    steps = range(2, 13)  # 11 steps: the last group is short
    want = _ids(Grouped(per_read), 0, steps)
    assert len(want) == len(steps)
    assert _ids(Grouped(per_read), 2, steps) == want


def test_steps_per_read_only_with_several_workers():
    assert steps_per_read(Grouped(5), 128, workers=2) == 5
    assert steps_per_read(Grouped(5), 128, workers=1) == 1
    assert steps_per_read(SyntheticSource(SyntheticConfig()), 128, workers=4) == 1
    items = StepBatches(Grouped(3), 0, 1, 4, range(7), group=3)
    assert len(items) == 3 and [len(items[k]) for k in range(3)] == [3, 3, 1]
