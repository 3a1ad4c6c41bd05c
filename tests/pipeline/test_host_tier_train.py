"""The trainer with a table on the host tier: the same run as on the device.

`embeddings.tables.item_emb.placement=host` moves the item table's shard and
optimizer state to host memory; on CPU ranks the tier's torch twin runs the
same schedule (staged prefetch in `sdd`, collision rows after the update in
`freescale`), so losses, evaluations, the table, its optimizer state and the
dense weights must be bit-identical to the device placement. The embedding
contract (every mode x optimizer, W = 1, 2, 4) is tests/embedding/test_host_tier.py.
"""

import pytest

import freescale
from freescale.config import build_config
from freescale.testing import run_ranks
from tests.pipeline.test_train import _train_and_collect, assert_same_run

COMMON = ["run.steps=8", "run.warmup=1", "evaluation.every=4", "evaluation.batches=1"]
HOST = "embeddings.tables.item_emb.placement=host"


def _same_as_on_device(world_size: int, extra: list[str]) -> dict:
    device = run_ranks(_train_and_collect, world_size, [*COMMON, *extra], timeout=240)
    host = run_ranks(_train_and_collect, world_size, [*COMMON, *extra, HOST], timeout=240)
    for rank in range(world_size):
        assert_same_run(device[rank], host[rank])
    return host[0]


@pytest.mark.parametrize(
    ("world_size", "extra"),
    [
        (1, ["run.mode=sdd", "embeddings.optimizer=adam"]),  # staged at `upcoming`
        pytest.param(
            2, ["run.mode=freescale", "embeddings.optimizer=adagrad"], marks=pytest.mark.slow
        ),
    ],
)
def test_a_host_table_trains_bit_identically_to_a_device_table(world_size, extra):
    host = _same_as_on_device(world_size, extra)
    assert {"host_tier_bytes", "host_tier_exposed_ms", "host_tier_gb_s"} <= set(
        host["summary_keys"]
    )


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("mode", ["sync", "sdd", "freescale"])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_every_mode_optimizer_and_world_size_on_the_host_tier(world_size, mode, optimizer):
    extra = [f"run.mode={mode}", f"embeddings.optimizer={optimizer}"]
    if world_size == 1 and mode == "freescale":
        extra.append("pipeline.prioritize=on")  # the split at one rank too
    _same_as_on_device(world_size, extra)


@pytest.mark.parametrize(
    ("setting", "line"),
    [
        ("embeddings.tables.item_emb.placement=disk", "placement must be one of device, host"),
        ("data.num_items=2000000000000", "host-tier tables need"),  # ~2 PB of rows
    ],
)
def test_a_bad_placement_or_too_little_host_memory_is_one_line_at_start(capsys, setting, line):
    """The memory check sizes the model on the meta device, before it takes memory."""
    from freescale.cli.main import main

    sets = [HOST, setting, "run.nproc=2", "run.steps=8", "output.progress=false"]
    rc = main(["train", *(x for s in sets for x in ("--set", s))])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and line in err[0], err


def test_sdd_staging_moves_each_row_once_per_step_as_sync_does():
    """Staged ahead of the current step's update, the rows that step read are
    deferred until the update has written them: sdd moves no more bytes than
    sync (it moved 1.34x as many when it read them ahead and again after)."""
    moved = {}
    for mode in ("sync", "sdd"):
        over = [*COMMON, f"run.mode={mode}", "run.steps=12", "evaluation.every=0", HOST,
                "data.step_overlap=1.0", "output.progress=false"]  # fmt: skip
        moved[mode] = freescale.train(config=build_config("demo", over)).summary["host_tier_bytes"]
    assert 0 < moved["sdd"] <= moved["sync"]
