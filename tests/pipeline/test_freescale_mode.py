"""`freescale` mode in the trainer: bit-identical to `sync` under every optimizer,
with the balancer, at several world sizes, with evaluation (a flush) mid-run.

The embedding-level contract (every optimizer, an lr schedule that changes
every step, collision rates 0-100%, empty ranks, checkpoints with a stash)
is tests/embedding/test_prioritized.py; these check the trainer wires it.
"""

import pytest

from freescale.testing import run_ranks
from tests.pipeline.test_train import _train_and_collect, assert_same_run

COMMON = ["steps=12", "warmup=2", "eval_every=5", "eval_batches=2"]


@pytest.mark.parametrize(
    ("world_size", "extra"),
    [
        (1, ["emb_optimizer=adam"]),
        (2, ["emb_optimizer=sgd", "balance=fbs"]),
        (2, ["emb_optimizer=adam", "step_overlap=0.2"]),
        # cost plans follow the data only with deterministic=true (the demo default)
        (2, ["emb_optimizer=adagrad", "balance=cost", "deterministic=true"]),
        (4, ["emb_optimizer=adagrad", "batch_size=8"]),
    ],
)
def test_freescale_mode_is_bit_identical_to_sync(world_size, extra):
    sync = run_ranks(_train_and_collect, world_size, [*COMMON, *extra, "mode=sync"], timeout=240)
    fs = run_ranks(_train_and_collect, world_size, [*COMMON, *extra, "mode=freescale"], timeout=240)
    for rank in range(world_size):
        assert_same_run(sync[rank], fs[rank])


def test_freescale_mode_reports_collisions_and_less_exposed_embedding_comm():
    out = run_ranks(_train_and_collect, 2, [*COMMON, "mode=freescale"], timeout=240)
    keys = out[0]["summary_keys"]
    assert {"collision_rows_pct", "collision_ids_pct", "exposed_collision_ms"} <= set(keys)
