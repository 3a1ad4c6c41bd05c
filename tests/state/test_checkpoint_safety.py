"""Checkpoints run no code and refuse damage (docs/security.md).

A payload whose unpickling runs ``touch SENTINEL`` is planted in each file that
``freescale train --resume`` and ``freescale eval`` read, once as a careless
attacker would (the manifest's digests no longer match) and once rewriting
the manifest's digests too: every run is refused with one line naming the
file, rc 2, and the sentinel never appears. Truncated and bit-flipped files
are refused the same way, and inside the ranks every rank raises the same
line before anything changes. The untouched checkpoint still resumes bit for
bit.
"""

import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from freescale.cli.main import main
from freescale.config import build_config
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks
from tests.state.test_resume import COMMON, _assert_same, _state

RUN = [
    "run.steps=10",
    "run.mode=sync",
    "balance=cost",
    "run.deterministic=true",
]  # a balancer's state too
READ = ["trainer.pt", "rank0.pt", "rank1.pt", "tables/.metadata"]
READ += ["tables/__0_0.distcp", "tables/__1_0.distcp"]


class Payload:
    """Runs ``touch path`` when unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def _train_rank(ckdir: str) -> dict:
    every = ["checkpoint.every=5", f"checkpoint.dir={ckdir}"]
    trainer = Trainer(build_config("demo", [*COMMON, *RUN, *every]))
    trainer.run()
    return _state(trainer)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(the checkpoint after step 4, each rank's state after the full run)."""
    ckdir = tmp_path_factory.mktemp("ck")
    full = run_ranks(_train_rank, 2, str(ckdir), timeout=240)
    return ckdir / "step-00000005", full


def _copy(made, tmp_path) -> Path:
    dest = tmp_path / "ck"
    shutil.copytree(made[0], dest)
    return dest


def _plant(ck: Path, name: str, payload: Payload) -> None:
    """``payload`` in ``ck/name`` the way an attacker would put it there."""
    path = ck / name
    if name.endswith(".pt"):
        state = torch.load(path, weights_only=True)
        state["extra"] = payload
        torch.save(state, path)
    elif name.endswith(".metadata"):
        index = pickle.loads(path.read_bytes())  # our own test file: trusted here
        index.planner_data = payload
        path.write_bytes(pickle.dumps(index))
    elif name.endswith(".distcp"):  # a chunk of this file, pointed at a new blob
        index_path = path.parent / ".metadata"
        index = pickle.loads(index_path.read_bytes())
        info = next(i for i in index.storage_data.values() if i.relative_path == path.name)
        blob = io.BytesIO()
        torch.save(payload, blob)
        info.offset, info.length = path.stat().st_size, len(blob.getvalue())
        with open(path, "ab") as f:
            f.write(blob.getvalue())
        index_path.write_bytes(pickle.dumps(index))
    else:  # the manifest: JSON, so a pickle there is just unreadable
        path.write_bytes(pickle.dumps(payload))


def _forge_digests(ck: Path) -> None:
    """Rewrite the manifest's sizes and digests to match the planted files."""
    manifest = json.loads((ck / "manifest.json").read_text())
    for name in manifest["files"]:
        data = (ck / name).read_bytes()
        manifest["files"][name] = [len(data), hashlib.sha256(data).hexdigest()]
    (ck / "manifest.json").write_text(json.dumps(manifest))


def _cli(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err  # one line, no traceback
    return rc, err[0]


def _both_commands(capsys, ck: Path) -> list[tuple[int, str]]:
    resume = [
        "train",
        "--set",
        "run.batch_size=16",
        "--set",
        "run.steps=12",
        "--set",
        "output.progress=false",
    ]
    return [_cli(capsys, *resume, "--resume", str(ck)), _cli(capsys, "eval", str(ck))]


@pytest.mark.parametrize("forged", [False, True], ids=["digests-stale", "digests-forged"])
@pytest.mark.parametrize("name", [*READ, "manifest.json"])
def test_a_planted_payload_is_refused_and_never_runs(made, tmp_path, capsys, name, forged):
    if forged and name == "manifest.json":
        pytest.skip("the manifest holds the digests")
    ck, sentinel = _copy(made, tmp_path), tmp_path / "PWNED"
    _plant(ck, name, Payload(sentinel))
    if forged:
        _forge_digests(ck)
    # a chunk is re-pointed through the index: either changed file may be named first
    named = [name, "tables/.metadata"] if name.endswith(".distcp") and not forged else [name]
    for rc, line in _both_commands(capsys, ck):
        assert rc == 2 and line.startswith("freescale: error: checkpoint file"), line
        assert any(f"checkpoint file {ck / n} " in line for n in named), line
        if forged:
            assert "holds posix.system, which a checkpoint may not hold" in line, line
    assert not sentinel.exists()


@pytest.mark.parametrize("name", ["trainer.pt", "rank1.pt", "tables/__1_0.distcp"])
def test_truncated_and_bit_flipped_files_are_refused(made, tmp_path, capsys, name):
    ck = _copy(made, tmp_path)
    data = (ck / name).read_bytes()
    (ck / name).write_bytes(data[: len(data) // 2])
    for rc, line in _both_commands(capsys, ck):
        assert rc == 2 and f"checkpoint file {ck / name} is {len(data) // 2} bytes" in line, line
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    (ck / name).write_bytes(flipped)
    for rc, line in _both_commands(capsys, ck):
        assert rc == 2 and f"checkpoint file {ck / name} was altered or damaged" in line, line


def test_an_older_format_is_refused_with_one_line(made, tmp_path, capsys):
    ck = _copy(made, tmp_path)
    manifest = json.loads((ck / "manifest.json").read_text())
    del manifest["format"], manifest["files"]
    (ck / "manifest.json").write_text(json.dumps(manifest))
    for rc, line in _both_commands(capsys, ck):
        assert rc == 2 and f"checkpoint {ck} is in an older format" in line, line


def _restore_rank(ck: str) -> dict:
    """Resume from ``ck`` (the ranks' own check, as under torchrun or the API)."""
    trainer = Trainer(build_config("demo", [*COMMON, *RUN, f"checkpoint.resume={ck}"]))
    before = trainer.embeddings.full_table("item_emb")
    dense = {k: v.clone() for k, v in trainer.dense_state_dict().items()}
    try:
        trainer.run()
        error = ""
    except ValueError as e:
        error = str(e)
    after = trainer.dense_state_dict()
    unchanged = torch.equal(before, trainer.embeddings.full_table("item_emb")) and all(
        torch.equal(v, after[k]) for k, v in dense.items()
    )
    return {"error": error, "unchanged": unchanged}


def _damage(ck: Path, how: str) -> str:
    """Damage ``ck`` as ``how`` says; the file every rank must name."""
    if how == "truncated":  # a table file
        name = "tables/__0_0.distcp"
        data = (ck / name).read_bytes()
        (ck / name).write_bytes(data[:100])
    elif how == "bit-flipped":  # tensor bytes that one rank alone hashes: only the digest sees it
        name = "tables/__1_0.distcp"
        data = bytearray((ck / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (ck / name).write_bytes(data)
    else:  # a payload in the file only rank 1 loads, digests forged
        name = "rank1.pt"
        _plant(ck, name, Payload(ck.parent / "PWNED"))
        _forge_digests(ck)
    return str(ck / name)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["truncated", "bit-flipped", "payload"])
def test_every_rank_refuses_with_the_same_line_before_any_change(made, tmp_path, how):
    ck = _copy(made, tmp_path)
    named = _damage(ck, how)
    per_rank = run_ranks(_restore_rank, 2, str(ck), timeout=240)
    assert per_rank[0]["error"] == per_rank[1]["error"], per_rank
    assert per_rank[0]["error"].startswith(f"checkpoint file {named} "), per_rank
    assert all(r["unchanged"] for r in per_rank)
    assert not (tmp_path / "PWNED").exists()


def _resume_rank(ck: str) -> dict:
    trainer = Trainer(build_config("demo", [*COMMON, *RUN, f"checkpoint.resume={ck}"]))
    torch.manual_seed(123)  # the RNG state must come from the checkpoint
    trainer.run()
    return _state(trainer)


@pytest.mark.slow
def test_the_untouched_checkpoint_resumes_bit_identically(made, tmp_path):
    ck = _copy(made, tmp_path)
    resumed = run_ranks(_resume_rank, 2, str(ck), timeout=240)
    for full, again in zip(made[1], resumed, strict=True):
        assert [s for s, _ in again["losses"]] == list(range(5, 10))
        _assert_same(full, again)
