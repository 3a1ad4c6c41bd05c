"""``freescale export`` of a checkpoint: any world size, no process group, checked.

A checkpoint written by 2 ranks exports in this process (which never creates
a process group) and its program scores as the plain model loaded with the
run's own full state dict (`freescale.train(state_dict=True)`); a tampered
checkpoint is refused with the line ``--resume`` prints; a checkpoint of a
user model imports no code unless the caller names it.
"""

import json
import shutil

import pytest
import torch
import torch.distributed as dist

import freescale
from freescale.cli.main import main
from freescale.config import build_config
from freescale.models.sequence import build
from freescale.serving import load
from freescale.serving.loader import read_manifest
from freescale.state.checkpoint import check_resumable
from freescale.testing.batches import random_batch
from freescale.testing.tolerance import assert_reordered_close

DIM, ITEMS = 16, 500
RUN = ["run.nproc=2", "run.steps=1", "run.warmup=0", "run.batch_size=8", f"model.dim={DIM}",
       "model.layers=1", f"data.num_items={ITEMS}", "data.max_uih=32", "evaluation.every=0",
       "output.progress=false", "checkpoint.every=1"]  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the checkpoint directory written by 2 ranks, the run's full state dict)."""
    ck = tmp_path_factory.mktemp("ck")
    result = freescale.train(config=build_config("demo", [*RUN, f"checkpoint.dir={ck}"]),
                             state_dict=True)  # fmt: skip
    return ck / "step-00000001", result.state_dict


def test_a_2_rank_checkpoint_exports_in_a_process_without_a_process_group(
    trained, tmp_path, capsys
):
    ck, state = trained
    assert main(["export", str(ck), str(tmp_path / "out")]) == 0
    assert not dist.is_initialized()
    printed = capsys.readouterr()
    line = json.loads(printed.out.strip().splitlines()[-1])
    # progress on stderr: the trace (minutes at long sequences) says when it starts and ends
    said = printed.err.splitlines()
    assert said[0].startswith("freescale export: tracing") and "model.pt2 written in" in said[1]
    manifest = read_manifest(tmp_path / "out")
    assert line["checkpoint_sha256"] == manifest["source"]["manifest_sha256"]
    assert manifest["amp"] == "none"  # --amp auto on the CPU
    assert manifest["source"]["world_size"] == 2
    plain = build(freescale.DataSchema.standard(ITEMS, 4), dim=DIM, layers=1)
    plain.load_state_dict(state)
    plain.eval()
    served = load(tmp_path / "out")
    for seed, size in enumerate((1, 3, 8)):
        batch = random_batch(seed, size, max_uih=20, num_items=ITEMS, dense_dim=None)
        with torch.no_grad():
            expected = plain(batch)
        assert_reordered_close(served(batch), expected, terms=4 * DIM, depth=2)


def test_a_tampered_checkpoint_is_refused_as_resume_refuses_it(trained, tmp_path, capsys):
    ck = shutil.copytree(trained[0], tmp_path / "ck")
    chunk = ck / "tables" / "__1_0.distcp"
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 1
    chunk.write_bytes(bytes(data))
    assert main(["export", str(ck), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    config = json.loads((ck / "manifest.json").read_text())["config"]
    with pytest.raises(ValueError) as resume:
        check_resumable(str(ck), {**config, "eval_only": True})
    assert err == f"freescale: error: {resume.value}"
    assert "was altered or damaged" in err and not (tmp_path / "out").exists()


def test_a_user_model_is_imported_only_when_named(trained, tmp_path, capsys):
    ck = shutil.copytree(trained[0], tmp_path / "ck")
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["config"]["model"] = {"factory": "examples.categories:build", "options": {}}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    assert main(["export", str(ck), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--model examples.categories:build" in err and err.count("\n") == 1
    assert main(["export", str(ck), str(tmp_path / "o"), "--model", "x.y:z"]) == 2
    assert "not x.y:z" in capsys.readouterr().err


def test_the_cli_exports_either_attention(trained, tmp_path, capsys):
    """``--attention jagged`` (the default): the model's own attention, bitwise on
    the CPU; ``--attention padded``: the self-contained program, within the
    reordered-sum bound; any other word: argparse's one line, rc 2."""
    ck, state = trained
    plain = build(freescale.DataSchema.standard(ITEMS, 4), dim=DIM, layers=1)
    plain.load_state_dict(state)
    plain.eval()
    batch = random_batch(5, 6, max_uih=20, num_items=ITEMS, dense_dim=None)
    with torch.no_grad():
        expected = plain(batch)
    for word in ("jagged", "padded"):
        out = tmp_path / word
        assert main(["export", str(ck), str(out), "--attention", word]) == 0
        assert read_manifest(out)["attention"] == word
        got = load(out)(batch)
        if word == "jagged":
            assert torch.equal(got, expected)
        else:
            assert_reordered_close(got, expected, terms=4 * DIM, depth=2)
    with pytest.raises(SystemExit) as info:
        main(["export", str(ck), str(tmp_path / "x"), "--attention", "dense"])
    assert info.value.code == 2
    assert "invalid choice: 'dense'" in capsys.readouterr().err


def test_export_amp_bf16_from_the_cli(trained, tmp_path):
    """``freescale export --amp bf16``: the program computes under bf16 autocast
    (within bf16's reordered-sum bound of the plain model under it), float32 out."""
    from freescale.testing.tolerance import reduction_tol

    ck, state = trained
    assert main(["export", str(ck), str(tmp_path / "out"), "--amp", "bf16"]) == 0
    assert read_manifest(tmp_path / "out")["amp"] == "bf16"
    plain = build(freescale.DataSchema.standard(ITEMS, 4), dim=DIM, layers=1)
    plain.load_state_dict(state)
    plain.eval()
    batch = random_batch(7, 6, max_uih=20, num_items=ITEMS, dense_dim=None)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        expected = plain(batch).float()
    got = load(tmp_path / "out")(batch)
    tol = reduction_tol(torch.bfloat16, 4 * DIM, 1.0, 2)
    assert got.dtype == torch.float32
    assert (got - expected).abs().max().item() <= tol["atol"] + tol["rtol"]
