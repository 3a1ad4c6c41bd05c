"""The AOTInductor compile runs in a child process: its failures are one paragraph."""

import subprocess

import pytest

from freescale.serving import aoti
from freescale.serving.aoti import MARK, CompileError, _reason, compile_package


def test_a_failed_compile_is_one_paragraph(tmp_path):
    with pytest.raises(CompileError) as info:
        compile_package(tmp_path / "missing.pt2", tmp_path / "out.pt2")
    text = str(info.value)
    assert "\n" not in text and len(text) < 1000
    assert "AOTInductor could not compile" in text and "rc 1" in text
    assert "missing.pt2" in text and "serves" in text


@pytest.mark.parametrize(
    "rc, stderr, ended",
    [(-11, "UserWarning: a buffer is not writable", "signal SIGSEGV"),
     (1, "ValueError: the program has no weights ['w']", "rc 1")],
)  # fmt: skip
def test_a_package_that_does_not_load_is_removed(tmp_path, monkeypatch, rc, stderr, ended):
    """Compiled, then the child's load of it crashed (an H200, torch 2.11): the
    caller gets one paragraph and no package that would kill its server."""
    package = tmp_path / "model_aoti.pt2"
    package.write_bytes(b"compiled")

    def child(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, rc, stdout=MARK + "{}\n", stderr=stderr)

    monkeypatch.setattr(aoti.subprocess, "run", child)
    with pytest.raises(CompileError) as info:
        compile_package(tmp_path / "model.pt2", package)
    text = str(info.value)
    assert not package.exists()
    assert "\n" not in text and "failed to load in a fresh process" in text and ended in text
    assert ("no weights" in text) == (rc > 0) and "not writable" not in text and "serves" in text


def test_the_reason_keeps_the_assert_and_the_last_errors():
    stderr = "\n".join(
        ["warning: something"]
        + ["k.py:33: block: [1,0,0] Assertion `index out of bounds: 0 <= tmp4 < ks0` failed."] * 50
        + ["Traceback (most recent call last):", '  File "x.py", line 1',
           "torch._inductor.exc.InductorError: AcceleratorError: CUDA error: device-side assert",
           "frame #0: c10::Error::Error(...)"]
    )  # fmt: skip
    got = _reason(stderr)
    assert got.count("Assertion") == 1 and "index out of bounds" in got
    assert "InductorError: AcceleratorError" in got and "frame #0" not in got


def test_a_failed_compile_leaves_a_program_that_serves(tmp_path, monkeypatch):
    """The manifest is written before the error: ``load(OUT, aoti=False)`` serves."""
    import torch

    from freescale.serving import ExportError, export_model, exporter, load
    from freescale.serving.loader import read_manifest
    from tests.serving.test_export import MODELS, batches, example

    def fail(program, package):
        raise CompileError("AOTInductor could not compile it (planted)")

    monkeypatch.setattr(exporter, "compile_package", fail)
    torch.manual_seed(0)
    model = MODELS["categories"][0]().eval()
    with pytest.raises(ExportError, match="planted"):
        export_model(model, example("categories"), tmp_path, aoti=True)
    assert read_manifest(tmp_path)["aoti_error"].endswith("(planted)")
    served = load(tmp_path, aoti=False)
    batch = batches("categories", 2)[1]
    with torch.no_grad():
        assert torch.equal(served(batch), model(batch))
