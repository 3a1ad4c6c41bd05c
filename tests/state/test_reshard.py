"""Checkpoints reshard: written by 2 ranks, resumed by 1 or 4.

Right after loading, every rank's gathered tables, their optimizer state and
update counts, the dense weights, Adam's state and the cost model equal the
checkpoint's bit for bit (Python path: `Trainer`; launcher path:
`freescale.train` and the CLI); training then continues. A 2 -> 4 -> 2 round
trip (saved again by 4 ranks, resumed by 2) is the uninterrupted 2-rank run
exactly, losses included: the data position (samples seen) survives the
detour. A user model of two tables (examples/categories.py, a data source
without ``starting_at``) reshards the same way.
"""

import json
import math
from functools import cache

import pytest
import torch

import freescale
from examples.categories import build, data
from freescale.cli.main import main
from freescale.config import build_config
from freescale.pipeline.train import Trainer
from freescale.state.checkpoint import PREFIX
from freescale.testing import run_ranks
from tests.state.test_resume import COMMON

RUN = [*COMMON, "run.steps=5", "run.mode=sync", "balance=cost", "run.deterministic=true"]
AT = 3  # the checkpoint continues at step 3
SEEN = AT * 2 * 16  # samples consumed by 2 ranks of batch 16 before it


def _state(trainer: Trainer) -> dict:
    emb = trainer.embeddings
    return {
        "tables": {t: emb.full_table(t) for t in emb.tables},
        "emb_opt": {t: emb.full_optimizer_state(t) for t in emb.tables},
        "emb_steps": {t: emb.step_of(t) for t in emb.tables},
        "dense": {k: v.detach().clone() for k, v in trainer.dense_state_dict().items()},
        "adam": [{k: v.clone() for k, v in s.items()} for s in trainer.optimizer.state.values()],
        "cost": trainer.balance.balancer.cost_model.state_dict() if trainer.balance else None,
    }


def _assert_equal(a: dict, b: dict) -> None:
    assert a["tables"].keys() == b["tables"].keys()
    for t in a["tables"]:
        assert torch.equal(a["tables"][t], b["tables"][t]), t
        assert a["emb_opt"][t].keys() == b["emb_opt"][t].keys()
        for k in a["emb_opt"][t]:
            assert torch.equal(a["emb_opt"][t][k], b["emb_opt"][t][k]), (t, k)
    assert a["emb_steps"] == b["emb_steps"]
    assert a["dense"].keys() == b["dense"].keys()
    for k in a["dense"]:
        assert torch.equal(a["dense"][k], b["dense"][k]), k
    for sa, sb in zip(a["adam"], b["adam"], strict=True):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    if a["cost"] is not None:  # (no rows under deterministic=true: test_balancer_fake has some)
        assert torch.equal(a["cost"]["coef"], b["cost"]["coef"])
        assert len(a["cost"]["rows"]) == len(b["cost"]["rows"])
        for (fa, ta), (fb, tb) in zip(a["cost"]["rows"], b["cost"]["rows"], strict=True):
            assert torch.equal(fa, fb) and torch.equal(ta, tb)


def _recording(trainer: Trainer) -> Trainer:
    """Keeps its state at each checkpoint it writes (``trainer.at_save``)."""
    save, trainer.at_save = trainer.state.save, {}

    def recorded(next_step: int) -> None:
        save(next_step)
        trainer.at_save[next_step] = _state(trainer)

    trainer.state.save = recorded
    return trainer


def _loaded(trainer: Trainer) -> Trainer:
    """Keeps its state right after loading; writes it back at once when it has a
    ``checkpoint.dir`` (a checkpoint of the new world size, nothing trained)."""
    _recording(trainer)
    restore = trainer.state.restore

    def loaded(source):
        first, source = restore(source)
        trainer.loaded = _state(trainer)
        if trainer.cfg.checkpoint.dir:
            trainer.state.save(first)
        return first, source

    trainer.state.restore = loaded
    return trainer


def _trainer(wrap, overrides: list[str], example: bool) -> Trainer:
    if example:
        cfg = build_config("demo", [*COMMON, "run.steps=5", "run.batch_size=8", *overrides])
        return wrap(Trainer(cfg, model=build, data=data(num_categories=30)))
    return wrap(Trainer(build_config("demo", [*RUN, *overrides])))


def _save_rank(ckdir: str, example: bool = False) -> dict:
    """The uninterrupted run: 5 steps, a checkpoint after step 2."""
    trainer = _trainer(_recording, [f"checkpoint.dir={ckdir}", f"checkpoint.every={AT}"], example)
    trainer.run()
    return {"at_save": trainer.at_save[AT], "losses": _losses(trainer), "end": _state(trainer)}


def _resume_rank(resume: str, overrides: list[str], example: bool = False) -> dict:
    trainer = _trainer(_loaded, [f"checkpoint.resume={resume}", *overrides], example)
    torch.manual_seed(123)  # the RNG state must come from the checkpoint
    summary = trainer.run()
    return {"loaded": trainer.loaded, "losses": _losses(trainer), "summary": summary,
            "end": _state(trainer)}  # fmt: skip


def _losses(trainer: Trainer) -> list:
    return [(s["step"], s["loss"]) for s in trainer.summary.steps]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the directory of the 2-rank checkpoints, the uninterrupted run's rank 0)."""
    ckdir = tmp_path_factory.mktemp("ck2")
    return ckdir, run_ranks(_save_rank, 2, str(ckdir), timeout=240)[0]


@pytest.fixture(scope="module")
def resumed(saved, tmp_path_factory):
    """Resume ``saved`` at ``world`` ranks (cached); 4 ranks write their own
    checkpoints (right after loading, and after step 4) into ``ck4``."""
    ck4 = tmp_path_factory.mktemp("ck4")

    @cache
    def at(world: int) -> list[dict]:
        again = [f"checkpoint.dir={ck4}", "checkpoint.every=5"] if world == 4 else []
        ck = f"{saved[0]}/{PREFIX}{AT:08d}"
        return run_ranks(_resume_rank, world, ck, again, timeout=240)

    at.ck4 = ck4
    return at


def _check_resumed(per_rank: list[dict], truth: dict, from_world: int, seen: int) -> None:
    for r in per_rank:
        _assert_equal(truth, r["loaded"])
        assert [s for s, _ in r["losses"]] == [3, 4]
        assert all(math.isfinite(x) for _, x in r["losses"])
    summary = per_rank[0]["summary"]
    assert summary["first_step"] == AT
    assert summary["resumed"] == {
        "step": AT, "from_world_size": from_world, "samples_seen": seen, "data_position": "sample"
    }  # fmt: skip


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_resume_at_another_world_size_is_exact_then_trains(saved, resumed, world):
    per_rank = resumed(world)
    assert len(per_rank) == world
    _check_resumed(per_rank, saved[1]["at_save"], 2, SEEN)
    item = per_rank[0]
    assert not torch.equal(item["end"]["tables"]["item_emb"], item["loaded"]["tables"]["item_emb"])


def test_a_2_4_2_round_trip_is_the_uninterrupted_run(saved, resumed):
    resumed(4)  # wrote ck4
    ck4 = resumed.ck4
    manifest = json.loads((ck4 / f"{PREFIX}{AT:08d}" / "manifest.json").read_text())
    assert (manifest["world_size"], manifest["step"], manifest["samples_seen"]) == (4, AT, SEEN)
    later = json.loads((ck4 / f"{PREFIX}{5:08d}" / "manifest.json").read_text())
    assert later["samples_seen"] == SEEN + 2 * 4 * 16  # two steps of 4 ranks
    back = run_ranks(_resume_rank, 2, str(ck4 / f"{PREFIX}{AT:08d}"), [], timeout=240)
    _check_resumed(back, saved[1]["at_save"], 4, SEEN)
    for r in back:  # the detour changed nothing: same batches, same numbers
        assert r["losses"] == saved[1]["losses"][AT:]
        _assert_equal(r["end"], saved[1]["end"])


@pytest.mark.parametrize(
    ("api_world", "cli_world"), [(1, 4), pytest.param(4, 1, marks=pytest.mark.slow)]
)
def test_the_launcher_and_the_cli_resume_at_another_world_size(saved, capsys, api_world, cli_world):
    """`freescale.train` restores (eval only: nothing trained) the checkpoint's
    tables and dense weights bit for bit; `freescale train --resume` trains on.
    (One of them spawns 4 ranks, the other runs 1: each world size once.)"""
    ck = str(saved[0] / f"{PREFIX}{AT:08d}")
    cfg = build_config("demo", [*RUN, "run.deterministic=false"])  # no global flag in this process
    result = freescale.train(
        config=cfg,
        run={"nproc": api_world},
        checkpoint={"resume": ck},
        eval_only=True,
        state_dict=True,
    )
    truth = saved[1]["at_save"]
    assert torch.equal(result.state_dict["item_emb.weight"], truth["tables"]["item_emb"])
    for k, v in truth["dense"].items():
        assert torch.equal(result.state_dict[k], v), k
    args = ["train", "--nproc", str(cli_world), "--resume", ck]
    args += [a for kv in RUN for a in ("--set", kv)]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["world_size"] == cli_world and summary["first_step"] == AT
    assert summary["resumed"] == {
        "step": AT, "from_world_size": 2, "samples_seen": SEEN, "data_position": "sample"
    }  # fmt: skip


@pytest.mark.slow
def test_a_user_model_of_two_tables_reshards(tmp_path):
    """examples/categories.py: 2 ranks save, 4 and 1 resume exactly; its data
    source has no ``starting_at``, so the run goes on at step 3 of the new world."""
    truth = run_ranks(_save_rank, 2, str(tmp_path), True, timeout=240)[0]["at_save"]
    ck = str(tmp_path / f"{PREFIX}{AT:08d}")
    for world in (4, 1):
        per_rank = run_ranks(_resume_rank, world, ck, [], True, timeout=240)
        for r in per_rank:
            _assert_equal(truth, r["loaded"])
            assert [s for s, _ in r["losses"]] == [3, 4]
        resumed = per_rank[0]["summary"]["resumed"]
        assert resumed == {"step": AT, "from_world_size": 2, "samples_seen": AT * 2 * 8,
                           "data_position": "step"}  # fmt: skip


def test_a_host_table_resumes_at_another_world_size(saved, resumed):
    """The 2-rank checkpoint of a device table resumes at 1 rank with the table on
    the host tier (placement is where rows live, not what they are): loaded
    exactly, then trained as on the device."""
    ck = f"{saved[0]}/{PREFIX}{AT:08d}"
    host = ["embeddings.tables.item_emb.placement=host"]
    (got,) = run_ranks(_resume_rank, 1, ck, host, timeout=240)
    _check_resumed([got], saved[1]["at_save"], 2, SEEN)
    assert "host_tier_bytes" in got["summary"]
