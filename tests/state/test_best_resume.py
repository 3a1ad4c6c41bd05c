"""``evaluation.keep_best`` survives a resume.

A checkpoint holds the best evaluation so far (metric, value, step,
evaluations since) and its weights: the dense copy in ``trainer.pt``, every
table's best rows in ``best/`` through DCP, resharded as ``tables/`` is. A
run cut short and resumed with ``checkpoint.resume=auto`` ends as the
uninterrupted run does, bit for bit: its ``eval`` (best, valid, test) and its
weights. So does a detour through 2 ranks (1 -> 2 -> 1, as test_reshard's
round trip: the 2-rank leg writes its checkpoint right after loading).

The data: a chain each user walks, learnt then overfit. The evaluations after
steps 1, 3, ..., 11 peak after step 5; patience 3 stops the run after step 11,
past the checkpoint at step 10: the weights restored at the end are the
checkpoint's copy, and the stop is counted across the resume. The checkpoint
written at the stop (step 12) resumes to the same eval and weights.
"""

import json
import shutil
from dataclasses import replace

import pytest
import torch

from freescale.cli.main import main
from freescale.config import build_config
from freescale.data.source import schema_of
from freescale.pipeline.setup import build_model, make_source
from freescale.pipeline.train import Trainer
from freescale.serving import load
from freescale.serving.checkpoint import table_keys
from freescale.serving.loader import read_manifest
from freescale.state.checkpoint import PREFIX
from freescale.testing import run_ranks

STEPS, EVERY, AT = 16, 2, 10  # a checkpoint after every other step; resumed at step 10
RUN = ["run.warmup=1", "run.batch_size=8", "data.samples_per_user=0", "evaluation.every=2",
       "output.progress=false", "model.dim=16", "model.layers=1"]  # fmt: skip
KEEP_BEST = ["evaluation.keep_best=ndcg@10", "evaluation.patience=3"]


def _cfg(data: str, steps: int, *keys: str, best: bool = True):
    keep = KEEP_BEST if best else []
    return build_config("demo", [f"data=sasrec:{data}", f"run.steps={steps}", *RUN, *keep, *keys])


def _run(cfg, save_on_load: bool = False) -> dict:
    """Train ``cfg``; what it restored (``loaded``), its summary and its final weights."""
    trainer, loaded = Trainer(cfg), {}
    restore = trainer.state.restore

    def restored(source):
        first, source = restore(source)
        best = trainer.evaluator.best
        if best is not None:
            loaded.update(value=best.value, step=best.step, since_best=best.since_best)
        if save_on_load:  # a checkpoint of this world size, nothing trained
            trainer.state.save(first)
        return first, source

    trainer.state.restore = restored
    torch.manual_seed(123)  # the RNG state must come from the checkpoint
    summary = trainer.run()
    emb = trainer.embeddings
    return {
        "loaded": loaded,
        "summary": summary,
        "losses": {s["step"]: s["loss"] for s in trainer.summary.steps},
        "evals": [(s["step"], s["eval"]["ndcg@10"]) for s in trainer.summary.steps if "eval" in s],
        "tables": {t: emb.full_table(t) for t in emb.tables},
        "dense": {k: v.detach().clone() for k, v in trainer.dense_state_dict().items()},
    }


def _same_weights(a: dict, b: dict) -> None:
    for part in ("tables", "dense"):
        assert a[part].keys() == b[part].keys()
        for k in a[part]:
            assert torch.equal(a[part][k], b[part][k]), (part, k)


def _interrupted_rank(data: str, full_dir: str, cut_dir: str) -> tuple[dict, dict, dict]:
    """(the uninterrupted run, one cut at step 10, it resumed by ``auto``)."""
    every = [f"checkpoint.every={EVERY}", "checkpoint.keep=4"]
    full = _run(_cfg(data, STEPS, f"checkpoint.dir={full_dir}", *every))
    auto = [f"checkpoint.dir={cut_dir}", *every, "checkpoint.resume=auto"]
    cut = _run(_cfg(data, AT, *auto))
    return full, cut, _run(_cfg(data, STEPS, *auto))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(data file, the full run's checkpoint dir, (full, cut, resumed) of rank 0)."""
    root = tmp_path_factory.mktemp("best")
    data = root / "chain.txt"
    data.write_text("".join(f"{u} {(u + i) % 37}\n" for u in range(30) for i in range(u % 5 + 4)))
    full_dir = root / "full"
    got = run_ranks(_interrupted_rank, 1, str(data), str(full_dir), str(root / "cut"))[0]
    return str(data), full_dir, got


def test_a_run_resumed_by_auto_ends_as_the_uninterrupted_one(runs):
    _, _, (full, cut, resumed) = runs
    # The premise: the best after step 5, worse ones at 7, 9 (before the cut) and 11.
    evals = dict(full["evals"])
    assert list(evals) == [1, 3, 5, 7, 9, 11]
    assert max(evals, key=evals.__getitem__) == 5
    best = full["summary"]["eval"]["best"]
    assert (best["step"], best["stopped_early"], best["value"]) == (6, True, evals[5])
    assert cut["summary"]["eval"]["best"]["stopped_early"] is False
    assert resumed["summary"]["first_step"] == AT
    assert resumed["loaded"] == {"value": evals[5], "step": 5, "since_best": 2}
    assert resumed["evals"] == full["evals"][-1:]  # one evaluation, worse: the stop
    assert resumed["losses"] == {s: full["losses"][s] for s in (10, 11)}
    assert resumed["summary"]["eval"] == full["summary"]["eval"]  # best, valid, test, ...
    _same_weights(resumed, full)


def test_a_restart_after_the_early_stop_replays_to_the_same_stop(runs):
    """No checkpoint is written at the stop (a resume there would train on):
    ``resume=auto`` takes the one before and stops where the run did."""
    data, full_dir, (full, _, resumed) = runs
    assert not (full_dir / f"{PREFIX}{12:08d}").exists()
    again = run_ranks(_resume_rank, 1, data, "auto", f"checkpoint.dir={full_dir}")[0]
    assert again["summary"]["first_step"] == AT
    assert again["losses"] == resumed["losses"]
    assert again["summary"]["eval"] == full["summary"]["eval"]
    _same_weights(again, full)


def _detour_rank(data: str, ck: str, out: str) -> dict:
    """Load ``ck`` at this world size, write it again at once, then evaluate
    (``eval_only``: the best weights put back, nothing trained)."""
    cfg = _cfg(data, STEPS, f"checkpoint.resume={ck}", f"checkpoint.dir={out}")
    return _run(replace(cfg, eval_only=True), save_on_load=True)


def _resume_rank(data: str, ck: str, *keys: str, best: bool = True) -> dict:
    return _run(_cfg(data, STEPS, f"checkpoint.resume={ck}", *keys, best=best))


def test_the_best_reshards_to_2_ranks_and_back(runs, tmp_path):
    data, full_dir, (full, _, resumed) = runs
    ck = full_dir / f"{PREFIX}{AT:08d}"
    two = run_ranks(_detour_rank, 2, data, str(ck), str(tmp_path), timeout=240)
    for r in two:  # the best rows gathered from 2 ranks: the 1-rank run's
        assert r["loaded"] == resumed["loaded"]
        _same_weights(r, full)
    best, truth = two[0]["summary"]["eval"]["best"], full["summary"]["eval"]["best"]
    # the epoch by samples consumed: the 1-rank steps before the detour count as such
    assert (best["value"], best["step"], best["epoch"]) == (truth["value"], truth["step"],
                                                            truth["epoch"])  # fmt: skip
    back = run_ranks(_resume_rank, 1, data, str(tmp_path / f"{PREFIX}{AT:08d}"))[0]
    assert back["summary"]["resumed"]["from_world_size"] == 2
    assert back["loaded"] == resumed["loaded"]
    assert back["losses"] == resumed["losses"]
    assert back["summary"]["eval"] == full["summary"]["eval"]
    _same_weights(back, full)


def _edges_rank(data: str, root: str, full_ck: str) -> dict:
    out = {}
    # keep_best, a checkpoint every step: step-1 comes before the first evaluation
    ck = [f"checkpoint.dir={root}/best", "checkpoint.every=1", "checkpoint.keep=4"]
    out["whole"] = _run(_cfg(data, 4, *ck))
    out["from_none"] = _resume_rank(data, f"{root}/best/{PREFIX}{1:08d}", "run.steps=4")
    # a checkpoint without keep_best, after an evaluation, resumed with it
    plain = [f"checkpoint.dir={root}/plain", "checkpoint.every=2"]
    _run(_cfg(data, 4, *plain, best=False))
    out["into_best"] = _resume_rank(data, f"{root}/plain/{PREFIX}{2:08d}", "run.steps=4")
    # one with a best resumed without keep_best: evaluated as it is
    cfg = _cfg(data, STEPS, f"checkpoint.resume={full_ck}", best=False)
    out["without"] = _run(replace(cfg, eval_only=True))
    return out


def test_no_best_before_the_first_evaluation_nor_without_keep_best(runs, tmp_path):
    data, full_dir, _ = runs
    got = run_ranks(_edges_rank, 1, data, str(tmp_path), str(full_dir / f"{PREFIX}{AT:08d}"))[0]
    first, second = (tmp_path / "best" / f"{PREFIX}{n:08d}" for n in (1, 2))
    saved = torch.load(first / "trainer.pt", weights_only=True)["best"]
    assert "value" not in saved and not (first / "best").exists()
    assert torch.load(second / "trainer.pt", weights_only=True)["best"]["step"] == 1
    assert (second / "best" / ".metadata").is_file()
    assert got["from_none"]["loaded"] == {"value": None, "step": -1, "since_best": 0}
    assert got["from_none"]["summary"]["eval"] == got["whole"]["summary"]["eval"]
    _same_weights(got["from_none"], got["whole"])
    assert not (tmp_path / "plain" / f"{PREFIX}{2:08d}" / "best").exists()
    assert got["into_best"]["loaded"] == {"value": None, "step": -1, "since_best": 0}
    assert got["into_best"]["summary"]["eval"]["best"]["step"] == 4  # its first evaluation
    assert got["without"]["loaded"] == {} and "best" not in got["without"]["summary"]["eval"]


def _cli(capsys, data: str, ck) -> str:
    keys = [f"data=sasrec:{data}", f"run.steps={STEPS}", *RUN, *KEEP_BEST]
    argv = ["train", "--nproc", "1", "--resume", str(ck)]
    assert main([*argv, *(a for kv in keys for a in ("--set", kv))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one line, no traceback
    return err[0]


def test_a_damaged_or_missing_best_file_is_refused(runs, tmp_path, capsys):
    data, full_dir, _ = runs
    ck = tmp_path / "ck"
    shutil.copytree(full_dir / f"{PREFIX}{AT:08d}", ck)
    manifest = json.loads((ck / "manifest.json").read_text())
    names = sorted(n for n in manifest["files"] if n.startswith("best/"))
    assert "best/.metadata" in names and len(names) >= 2  # every best file has a digest
    chunk = ck / next(n for n in names if n.endswith(".distcp"))
    flipped = bytearray(chunk.read_bytes())
    flipped[len(flipped) // 2] ^= 0x01
    chunk.write_bytes(flipped)
    assert f"checkpoint file {chunk} was altered or damaged" in _cli(capsys, data, ck)
    (ck / "best" / ".metadata").unlink()
    assert f"checkpoint file {ck / 'best' / '.metadata'} is missing" in _cli(capsys, data, ck)
    # trainer.pt names a best, the manifest lists no best rows
    shutil.rmtree(ck / "best")
    manifest["files"] = {k: v for k, v in manifest["files"].items() if k not in names}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    assert f"checkpoint {ck}: its manifest lists no best/.metadata" in _cli(capsys, data, ck)


def test_export_serves_the_best_weights_by_default(runs, tmp_path, capsys):
    """The newest checkpoint (after step 10) holds the best of step 6 beside the
    latest weights: ``freescale export`` serves the best (what the run's own
    final evaluation used), ``--weights latest`` the latest."""
    data, full_dir, (full, _, _) = runs
    ck = full_dir / f"{PREFIX}{AT:08d}"
    for weights in ("auto", "latest"):
        assert main(["export", str(ck), str(tmp_path / weights), "--weights", weights]) == 0
    manifest = read_manifest(tmp_path / "auto")["source"]
    assert manifest["weights"] == "best" and manifest["best"]["step"] == 6
    assert read_manifest(tmp_path / "latest")["source"]["weights"] == "latest"
    cfg = _cfg(data, STEPS)
    source = make_source(cfg)
    plain = build_model(cfg.model, schema_of(source)).eval()
    state = {**full["dense"], **{key: full["tables"][e.split(".")[0]] for e, key in
                                 table_keys(plain).items()}}  # fmt: skip
    plain.load_state_dict(state)  # the full run's final weights: its best
    batch = source.eval_batch("test", 0, 0, 1, 8)
    with torch.no_grad():
        expected = plain(batch)
    assert torch.equal(load(tmp_path / "auto")(batch), expected)
    assert not torch.equal(load(tmp_path / "latest")(batch), expected)
    plain_dir = tmp_path / "plain"  # a run without keep_best: no best to export
    run_ranks(_plain_rank, 1, data, str(plain_dir))
    capsys.readouterr()
    assert main(["export", str(plain_dir), str(tmp_path / "b"), "--weights", "best"]) == 2
    assert "holds no best evaluation" in capsys.readouterr().err


def _plain_rank(data: str, ckdir: str) -> None:
    _run(_cfg(data, 2, f"checkpoint.dir={ckdir}", "checkpoint.every=2", best=False))
