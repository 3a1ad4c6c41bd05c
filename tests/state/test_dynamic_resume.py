"""Checkpoints of a dynamic table (``embeddings.tables.item_emb.capacity``), from the trainer.

The item table holds fewer rows than the run's distinct ids (evictions at
every step from step 2 on). Stopped after step 3 and resumed at the same world
size, every mode continues bit for bit: losses, every slot's row and optimizer
state, the map, the dense weights. Resumed at another world size it trains on
with every id held at the stop on its new owner, or dropped by the rule
(`freescale.embedding.state.dynamic_entries`). The manifest covers the
dynamic entries (one changed byte is refused); the plain state dict gives the
table by id.
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from freescale.cli.main import main
from freescale.config import MODES, build_config
from freescale.embedding.dynamic import owner_of
from freescale.embedding.state.dcp_safe import SafeReader, read_metadata
from freescale.embedding.state.dynamic_entries import rows_by_id
from freescale.pipeline.train import Trainer
from freescale.state.checkpoint import PREFIX, check_resumable
from freescale.state.checkpoint_files import TABLES
from freescale.state.export import full_state_dict
from freescale.testing import run_ranks
from tests.state.test_resume import COMMON

CAPACITY = "embeddings.tables.item_emb.capacity"
DYN = [f"{CAPACITY}=600", "run.steps=6", "run.deterministic=true"]
AT = 3  # the checkpoint continues at step 3


def _state(trainer: Trainer) -> dict:
    emb = trainer.embeddings
    store, _ = emb._locate("item_emb")
    slots = {"weight": store.weight, **store.optimizer_state(), **store.dynamic.map.tensors()}
    return {
        "losses": [(s["step"], s["loss"]) for s in trainer.summary.steps],
        "evictions": sum(s["dynamic_evictions"] for s in trainer.summary.steps),
        "slots": {k: v.clone() for k, v in slots.items()},
        "by_id": emb.dynamic_rows("item_emb"),
        "step": emb.step_of("item_emb"),
        "dense": {k: v.detach().clone() for k, v in trainer.dense_state_dict().items()},
        "plain": full_state_dict(trainer.model, emb, trainer.sparse.swapped),
    }


def _trainer(overrides: list[str]) -> Trainer:
    torch.manual_seed(123)  # a resumed run's RNG state must come from the checkpoint
    return Trainer(build_config("demo", [*COMMON, *DYN, *overrides]))


def _full(mode: str, ckdir: str) -> dict:
    """The uninterrupted run; also the table by id when the checkpoint was written."""
    trainer = _trainer([f"run.mode={mode}", f"checkpoint.dir={ckdir}", f"checkpoint.every={AT}"])
    save, at_save = trainer.state.save, {}

    def recorded(next_step: int) -> None:
        save(next_step)
        at_save[next_step] = trainer.embeddings.dynamic_rows("item_emb")

    trainer.state.save = recorded
    trainer.run()
    return {**_state(trainer), "at_save": at_save[AT]}


def _resumed(resume: str, overrides: list[str]) -> dict:
    """A run resumed from ``resume``; also the table by id and the map right after loading."""
    trainer = _trainer([f"checkpoint.resume={resume}", *overrides])
    restore, loaded = trainer.state.restore, {}

    def recorded(source):
        out = restore(source)
        loaded["at_load"] = trainer.embeddings.dynamic_rows("item_emb")
        held = trainer.embeddings._locate("item_emb")[0].dynamic.map.tensors()
        loaded["map"] = {k: v.clone() for k, v in held.items()}
        return out

    trainer.state.restore = recorded
    trainer.run()
    return {**_state(trainer), **loaded}


def _every_mode(ckdir: str) -> dict:
    out = {}
    for mode in MODES:
        full = _full(mode, f"{ckdir}/{mode}")
        ck = f"{ckdir}/{mode}/{PREFIX}{AT:08d}"
        out[mode] = (full, _resumed(ck, [f"run.mode={mode}"]))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(checkpoint directory, per rank {mode: (uninterrupted, resumed at step 3)}) at 2 ranks."""
    ckdir = tmp_path_factory.mktemp("dyn")
    return ckdir, run_ranks(_every_mode, 2, str(ckdir), timeout=240)


@pytest.mark.parametrize("mode", MODES)
def test_a_dynamic_table_resumes_bit_for_bit_at_the_same_world_size(runs, mode):
    for per_mode in runs[1]:
        full, resumed = per_mode[mode]
        assert full["evictions"] > 100  # at every step after the first two
        assert [s for s, _ in resumed["losses"]] == list(range(AT, 6))
        losses = dict(full["losses"])
        assert all(losses[s] == loss for s, loss in resumed["losses"]), mode
        assert full["step"] == resumed["step"] == 6
        for key, value in full["slots"].items():  # slot for slot, the map included
            assert torch.equal(value, resumed["slots"][key]), (mode, key)
        for key, value in full["dense"].items():
            assert torch.equal(value, resumed["dense"][key]), (mode, key)


def test_the_plain_state_dict_holds_a_dynamic_table_by_id(runs):
    full, _ = runs[1][0]["sync"]
    ids, rows, state = full["by_id"]
    plain = full["plain"]
    assert torch.equal(plain["item_emb.ids"], ids) and torch.equal(plain["item_emb.weight"], rows)
    assert ids.numel() > 0 and bool((ids[1:] > ids[:-1]).all())
    assert state.keys() and all(torch.equal(plain[f"item_emb.optimizer.{k}"], v)
                                for k, v in state.items())  # fmt: skip
    assert runs[1][1]["sync"][0]["plain"] is None  # rank 0's


def _entries(runs, mode: str) -> dict:
    """The tables of a checkpoint, read without ranks (as an export reads them)."""
    tables = runs[0] / mode / f"{PREFIX}{AT:08d}" / TABLES
    saved = read_metadata(tables).state_dict_metadata
    entries = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in saved.items()}
    with warnings.catch_warnings():  # "no process group: loading in one process", as meant
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(entries, storage_reader=SafeReader(tables), no_dist=True)
    return entries


@pytest.mark.parametrize("mode", MODES)
def test_the_checkpoint_holds_the_table_by_id(runs, mode):
    """The ids held at the save, each with its row and optimizer state; every
    mode writes what the synchronous run does (`freescale` has mapped step 3
    when it saves, its entries are taken as before that)."""
    entries = _entries(runs, mode)
    ids, rows, state = rows_by_id(entries, "item_emb.")
    want_ids, want_rows, want_state = runs[1][0]["sync"][0]["at_save"]
    assert torch.equal(ids, want_ids) and torch.equal(rows, want_rows)
    assert state.keys() == want_state.keys()
    for k, v in want_state.items():
        assert torch.equal(state[k], v), k
    assert entries["item_emb.dynamic.layout"].tolist() == [2, 370]  # 2 ranks of 370 slots
    sync = _entries(runs, "sync")
    assert entries.keys() == sync.keys()
    for k, v in sync.items():
        assert torch.equal(entries[k], v), k


def test_a_changed_byte_of_a_dynamic_entry_is_refused(runs, tmp_path):
    ck = runs[0] / "sync" / f"{PREFIX}{AT:08d}"
    cfg = build_config("demo", [*COMMON, *DYN, f"checkpoint.resume={ck}"]).as_dict()
    check_resumable(str(ck), cfg)  # untouched: fine
    md = read_metadata(ck / TABLES)
    entry = next(i for k, i in md.storage_data.items() if k.fqn == "item_emb.dynamic.last_used")
    data = ck / TABLES / entry.relative_path
    blob = bytearray(data.read_bytes())
    blob[entry.offset + entry.length - 8] ^= 1  # a last use in the entry's last bytes
    data.write_bytes(bytes(blob))
    with pytest.raises(ValueError, match=f"{entry.relative_path} was altered or damaged"):
        check_resumable(str(ck), cfg)


# slow: the in-process twin is tests/embedding/test_dynamic_state.py (2 -> 3, 4 -> 2)
@pytest.mark.slow
def test_a_dynamic_table_resumes_at_another_world_size_by_id(runs, capfd):
    """Saved by 2 ranks in the `freescale` mode (which maps step 3 before it
    saves: the synchronous run's table is saved), resumed by 3 with room for
    the larger global batch: each held id on its owner, its row and state as
    saved, in id order; training goes on."""
    ids, rows, state = runs[1][0]["sync"][0]["at_save"]  # (what every mode saves)
    ck = str(runs[0] / "freescale" / f"{PREFIX}{AT:08d}")
    per_rank = run_ranks(_resumed, 3, ck, ["run.mode=freescale", f"{CAPACITY}=900"], timeout=240)
    assert "did not fit" not in capfd.readouterr().err
    for rank, r in enumerate(per_rank):
        assert [s for s, _ in r["losses"]] == list(range(AT, 6))
        assert all(math.isfinite(x) for _, x in r["losses"])
        got_ids, got_rows, got_state = r["at_load"]
        assert torch.equal(got_ids, ids) and torch.equal(got_rows, rows)
        assert got_state.keys() == state.keys()
        for k, v in state.items():
            assert torch.equal(got_state[k], v), k
        held = r["map"]["slot_ids"][r["map"]["occupied"]]
        assert torch.equal(held, ids[owner_of(ids, 3) == rank])  # slots 0, 1, ... by id


@pytest.mark.slow
def test_the_cli_resumes_a_dynamic_table_from_4_ranks_at_2_with_fewer_rows(tmp_path, capfd):
    """4 ranks hold up to 4 x 285 rows (1085 at step 3); resumed by 2 with a smaller table
    (2 x 425 slots) the least recently used go, in one line; training goes on."""
    run = [*COMMON, "run.steps=6", "run.mode=freescale"]
    args = [a for kv in run for a in ("--set", kv)]
    every = ["--set", f"checkpoint.dir={tmp_path}", "--set", f"checkpoint.every={AT}"]
    assert main(["train", "--nproc", "4", *args, *every, "--set", f"{CAPACITY}=900"]) == 0
    capfd.readouterr()
    ck = str(tmp_path / f"{PREFIX}{AT:08d}")
    assert main(["train", "--nproc", "2", *args, "--set", f"{CAPACITY}=700", "--resume", ck]) == 0
    out, err = capfd.readouterr()
    dropped = [ln for ln in err.splitlines() if "did not fit" in ln]
    assert len(dropped) == 1, err
    assert dropped[0].startswith(
        "freescale: dynamic table 'item_emb' saved by 4 ranks, loaded by 2 of 425 slots each: "
    )
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["first_step"] == AT and math.isfinite(summary["train_ne_last"])


def test_keep_best_with_a_dynamic_table_is_one_line():
    """The best evaluation's copy keeps each slot's row, not which id it had:
    restored after evictions it would give rows to other ids."""
    keys = ["evaluation.every=2", "evaluation.keep_best=auc", f"{CAPACITY}=600"]
    with pytest.raises(ValueError) as e:
        build_config("demo", keys)
    assert str(e.value) == (
        "evaluation.keep_best does not keep dynamic tables yet: set "
        "embeddings.tables.item_emb.capacity=0 or evaluation.keep_best=''"
    )
