"""The recipes' training options on CPU ranks: dropout, lr schedules and weight decay keep the
modes bit-identical and a resume bit-identical; each does what it says."""

import math

import pytest
import torch

from freescale.config import EvaluationSection, build_config
from freescale.pipeline.dense import GuardedAdam
from freescale.pipeline.lr_schedule import LrSchedule
from freescale.pipeline.setup import make_source, resolve_epochs
from freescale.pipeline.train import Trainer
from freescale.state.best import BestWeights
from freescale.testing import run_ranks
from tests.state.test_resume import COMMON, _assert_same, _resume_rank, _state

OPTIONS = [
    "model.emb_dropout=0.3", "model.attn_dropout=0.2", "model.ffn_dropout=0.2",
    "dense.weight_decay=0.05", "dense.lr_warmup=3", "dense.lr_decay=cosine",
    "embeddings.weight_decay=0.02", "embeddings.lr_warmup=2", "embeddings.lr_decay=linear",
    "model.loss=softmax",
]  # fmt: skip


def _run(overrides: list[str]) -> dict:
    trainer = Trainer(build_config("demo", [*COMMON, *overrides]))
    before = trainer.embeddings.full_table("item_emb")
    trainer.run()
    return {**_state(trainer), "before": before, "lr": trainer.optimizer.param_groups[0]["lr"]}


def _sync_and_resumed(overrides: list[str], ckdir: str) -> tuple[dict, dict, dict]:
    """(sync, freescale with checkpoints, freescale resumed at step 5) on this rank."""
    sync = _run([*overrides, "run.mode=sync"])
    return (sync, *_resume_rank([*overrides, "run.mode=freescale"], ckdir))


def _modes_and_resume(world: int, tmp_path) -> None:
    overrides = [*OPTIONS, "run.steps=10", "data.max_uih=24", "data.length_cap=24"]
    for sync, full, resumed in run_ranks(_sync_and_resumed, world, overrides, str(tmp_path)):
        _assert_same(sync, full)  # the modes: bit-identical with every option on
        assert [s for s, _ in resumed["losses"]] == list(range(5, 10))
        _assert_same(full, resumed)  # and so is a resumed run


def test_modes_and_resume_stay_bit_identical_with_every_option_on(tmp_path):
    _modes_and_resume(2, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 3, 4])
def test_modes_and_resume_stay_bit_identical_with_every_option_on_slow(world, tmp_path):
    _modes_and_resume(world, tmp_path)


def _variants(base: list[str], variants: list[list[str]]) -> list[dict]:
    return [_run([*base, *extra]) for extra in variants]


def test_each_option_changes_training():
    """Each option changes the run (a test that fails without its plumbing);
    weight decay reaches only the rows the steps read; the dense lr follows
    its schedule."""
    base = ["run.steps=4", "run.mode=sync", "data.max_uih=24", "data.length_cap=24"]
    variants = [[], ["model.emb_dropout=0.5"], ["embeddings.weight_decay=0.5"],
                ["dense.lr=0.01", "dense.lr_warmup=2", "dense.lr_decay=linear"],
                ["embeddings.lr_warmup=2"], ["model.loss=softmax"]]  # fmt: skip
    plain, dropped, decayed, scheduled, emb, softmax = run_ranks(_variants, 1, base, variants)[0]
    assert plain["losses"][1:] != dropped["losses"][1:]
    assert plain["losses"][0] != softmax["losses"][0]
    assert plain["losses"][0] == emb["losses"][0] and not torch.equal(plain["table"], emb["table"])
    assert scheduled["lr"] == LrSchedule(0.01, 2, "linear", 4)(4) != 0.01
    read = (plain["table"] != plain["before"]).any(dim=1)
    assert torch.equal((decayed["table"] != decayed["before"]).any(dim=1), read)
    assert not torch.equal(decayed["table"][read], plain["table"][read])


def test_schedule_matches_the_closed_form():
    s = LrSchedule(lr=0.1, warmup=4, decay="cosine", total=20)
    assert [s(k) for k in (1, 2, 4)] == [0.025, 0.05, 0.1]
    assert s(5) == 0.1 and s(20) == pytest.approx(0.05 * (1 + math.cos(math.pi * 15 / 16)))
    lin = LrSchedule(lr=1.0, warmup=0, decay="linear", total=10)
    assert [lin(k) for k in (1, 6, 10)] == [1.0, 0.5, pytest.approx(0.1)]
    with pytest.raises(ValueError, match=r"dense\.lr_warmup \(6\) must be < the run's steps \(6\)"):
        build_config("demo", ["run.steps=6", "dense.lr_warmup=6"])
    with pytest.raises(ValueError, match=r"embeddings\.lr_decay must be one of"):
        build_config("demo", ["embeddings.lr_decay=step"])


def test_dense_weight_decay_is_decoupled_on_matrices_only():
    layer = torch.nn.Linear(3, 2)
    w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
    opt = GuardedAdam(list(layer.parameters()), lr=0.1, weight_decay=0.5)
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)  # Adam's own step is then 0: only the decay moves
    opt.step_unless(torch.zeros(()))
    assert torch.allclose(layer.weight, w * (1 - 0.1 * 0.5)) and torch.equal(layer.bias, b)


def test_epochs_set_the_steps_from_the_file(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("".join(f"{u} {i}\n" for u in range(40) for i in range(u % 7 + 3)))
    cfg = build_config("demo", [f"data=sasrec:{path}", "run.epochs=3", "run.batch_size=4",
                                "data.samples_per_user=0"])  # fmt: skip
    per_epoch = make_source(cfg).steps_per_epoch(2, 4)
    assert resolve_epochs(cfg, make_source(cfg), 2).run.steps == 3 * per_epoch > 0
    assert resolve_epochs(cfg, make_source(cfg), 2).evaluation.every == cfg.evaluation.every
    per_two = cfg.with_values(evaluation__every_epochs=2, evaluation__keep_best="auc")
    assert resolve_epochs(per_two, make_source(cfg), 2).evaluation.every == 2 * per_epoch
    with pytest.raises(ValueError, match=r"run\.epochs needs file data"):
        resolve_epochs(build_config("demo", ["run.epochs=2"]), make_source(build_config()), 2)
    with pytest.raises(ValueError, match=r"evaluation\.every_epochs needs run\.epochs"):
        build_config("demo", ["evaluation.every_epochs=1"])
    with pytest.raises(ValueError, match=r"keep_best needs evaluation\.every or"):
        build_config("demo", ["evaluation.every=0", "evaluation.keep_best=auc"])


def test_train_negatives_set_the_training_candidates(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("".join(f"{u} {i}\n" for u in range(12) for i in range(u % 5 + 4)))
    for extra, count in (
        ([], 5),
        (["data.train_negatives=16"], 17),
        (["data.train_negatives=0"], 1),
    ):
        cfg = build_config("demo", [f"data=sasrec:{path}", "run.batch_size=6", *extra])
        batch = make_source(cfg).batch(0, 0, 1, 6)
        assert batch.candidates.lengths().tolist() == [count] * 6
        assert batch.labels.sum().item() == 6  # one positive each, whatever the negatives
    with pytest.raises(ValueError, match=r"data\.train_negatives must be >= 0"):
        build_config("demo", ["data.train_negatives=-1"])


def _file_run(path: str) -> dict:
    over = [f"data=sasrec:{path}", "run.steps=8", "run.warmup=1", "run.batch_size=8",
            "data.samples_per_user=0", "evaluation.every=2", "evaluation.keep_best=ndcg@10",
            "output.progress=false", "model.dim=16"]  # fmt: skip
    return Trainer(build_config("demo", over)).run()


def test_keep_best_reports_and_evaluates_the_best(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text("".join(f"{u} {(u * i) % 37}\n" for u in range(30) for i in range(u % 5 + 4)))
    summary = run_ranks(_file_run, 1, str(path))[0]
    best = summary["eval"]["best"]
    assert best["metric"] == "ndcg@10" and best["step"] in (2, 4, 6, 8) and best["epoch"] > 0
    assert summary["eval"]["valid"]["ndcg@10"] == best["value"]


class _Store:
    def __init__(self) -> None:
        self.weight = torch.zeros(3)

    def join_update(self) -> None:
        pass


class _Dense:
    def __init__(self) -> None:
        self.state = {"w": torch.zeros(2)}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = {k: v.clone() for k, v in state.items()}


def test_keep_best_restores_the_best_weights_and_stops_after_patience():
    store, dense = _Store(), _Dense()
    best = BestWeights(
        EvaluationSection(keep_best="ndcg@10", patience=2), dense, _Embeddings(store)
    )
    for step, value in enumerate([0.1, 0.3, 0.2, 0.3]):
        store.weight.fill_(step)
        dense.state["w"].fill_(step)
        best.observe(step * 10 + 9, {"ndcg@10": value})
        assert best.stop == (step == 3)
    best.restore()
    assert store.weight.tolist() == [1.0] * 3 and dense.state["w"].tolist() == [1.0] * 2
    report = {"metric": "ndcg@10", "value": 0.3, "step": 20, "epoch": 1.0, "stopped_early": True}
    assert best.report(1.0) == report
    # What a checkpoint holds (the rows: `tables`, tests/state/test_best_resume.py)
    saved, dense = best.state_dict(), _Dense()
    again = BestWeights(EvaluationSection(keep_best="ndcg@10", patience=2), dense,
                        _Embeddings(_Store()))  # fmt: skip
    again.load_state_dict(saved)
    again.restore()
    assert (again.value, again.step, again.since_best, again.stop) == (0.3, 19, 2, True)
    assert dense.state["w"].tolist() == [1.0] * 2
    other = BestWeights(EvaluationSection(keep_best="auc"), _Dense(), _Embeddings(_Store()))
    other.load_state_dict(saved)  # another metric's best is none
    assert other.value is None and other.tables() is None


class _Embeddings:
    def __init__(self, store: _Store) -> None:
        self.stores = [store]
