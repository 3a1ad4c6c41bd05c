"""`freescale` mode in the trainer: bit-identical to `sync` under every optimizer,
with the balancer, at several world sizes, with evaluation (a flush) mid-run.

The embedding-level contract (every optimizer, an lr schedule that changes
every step, collision rates 0-100%, empty ranks, checkpoints with a stash)
is tests/embedding/test_prioritized.py; these check the trainer wires it.
"""

import pytest

from freescale.testing import run_ranks
from tests.pipeline.test_train import _train_and_collect, assert_same_run

COMMON = ["run.steps=12", "run.warmup=2", "evaluation.every=5", "evaluation.batches=2"]


@pytest.mark.parametrize(
    ("world_size", "extra"),
    [
        (1, ["embeddings.optimizer=adam", "pipeline.prioritize=on"]),  # the split at one rank too
        (2, ["embeddings.optimizer=sgd", "balance=fbs"]),
        (2, ["embeddings.optimizer=adam", "data.step_overlap=0.2"]),
        # cost plans follow the data only with deterministic=true (the demo default)
        (2, ["embeddings.optimizer=adagrad", "balance=cost", "run.deterministic=true"]),
        (4, ["embeddings.optimizer=adagrad", "run.batch_size=8"]),
    ],
)
def test_freescale_mode_is_bit_identical_to_sync(world_size, extra):
    sync = run_ranks(
        _train_and_collect, world_size, [*COMMON, *extra, "run.mode=sync"], timeout=240
    )
    fs = run_ranks(
        _train_and_collect, world_size, [*COMMON, *extra, "run.mode=freescale"], timeout=240
    )
    for rank in range(world_size):
        assert_same_run(sync[rank], fs[rank])


def test_freescale_mode_reports_collisions_and_less_exposed_embedding_comm():
    out = run_ranks(_train_and_collect, 2, [*COMMON, "run.mode=freescale"], timeout=240)
    keys = out[0]["summary_keys"]
    assert {"collision_rows_pct", "collision_ids_pct", "exposed_collision_ms"} <= set(keys)


def _schedule_and_collisions(overrides: list[str]) -> tuple[str, str, float]:
    from freescale.config import build_config
    from freescale.pipeline.train import Trainer

    trainer = Trainer(build_config("demo", [*overrides, "output.progress=false"]))
    trainer.run()
    collisions = [s["collision_rows_pct"] for s in trainer.summary.steps]
    return trainer.schedule_name, type(trainer.embeddings.mode).__name__, max(collisions)


def test_freescale_at_one_rank_runs_sdds_schedule_unless_asked():
    """At one rank there is no exchange for the split to hide: ``prioritize=auto``
    (the default) runs sdd's schedule, ``on`` the split (collisions reported);
    several ranks always split. (Same numbers either way: the test above.)"""
    common = [*COMMON, "run.mode=freescale", "evaluation.every=0"]
    auto1 = run_ranks(_schedule_and_collisions, 1, common, timeout=240)[0]
    on1 = run_ranks(_schedule_and_collisions, 1, [*common, "pipeline.prioritize=on"], timeout=240)[
        0
    ]
    auto2 = run_ranks(_schedule_and_collisions, 2, common, timeout=240)[0]
    assert auto1[:2] == ("sdd", "SparseDataDist") and auto1[2] == 0.0
    assert on1[:2] == ("freescale", "Prioritized") and on1[2] > 0.0
    assert auto2[:2] == ("freescale", "Prioritized") and auto2[2] > 0.0
