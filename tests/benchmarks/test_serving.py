"""The serving scenario measures the program when the AOTInductor package fails."""

from benchmarks import serving
from benchmarks.runner import Ctx
from benchmarks.scenario import load
from freescale.serving import exporter
from freescale.serving.aoti import CompileError


def test_a_package_that_fails_leaves_the_program_measured_and_the_reason_in_the_row(
    tmp_path, monkeypatch
):
    def fail(program, package):
        raise CompileError("AOTInductor compiled it, but the package failed to load (planted)")

    monkeypatch.setattr(exporter, "compile_package", fail)
    s = load("serving").smoked()
    s.params["aoti"] = True
    result = serving.measure(s, Ctx(out=tmp_path / "r", raw=tmp_path))
    (row,) = result.rows
    assert row["program"] == "export" and row["aoti_error"].endswith("(planted)")
    assert row["within_tolerance"] and row["served_ms"] > 0
