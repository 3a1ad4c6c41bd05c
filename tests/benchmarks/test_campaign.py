"""benchmarks/campaign.py (issue 19): the plan fits the device's calls, the
figure reports compute what they claim, and every part runs end to end on
gloo ranks with tiny grids (``--smoke``). Never timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import campaign  # noqa: E402
import campaign_report  # noqa: E402


def test_every_part_fits_one_call_and_the_largest_world_size_runs_first():
    for gpus in (2, 4, 8):
        todo = campaign.parts_for(gpus)
        sizes = [w for _, w in todo]
        assert sizes[0] == gpus and set(sizes) == {w for w in (2, 4, 8) if w <= gpus}
        per_w = [w for n, w in todo if not campaign.PARTS[n].only_largest]
        assert per_w == sorted(per_w, reverse=True)
        for call in campaign.calls_for(gpus):
            assert sum(m for *_, m in call) <= campaign.BUDGET_MIN
            assert len(call) <= 7  # the device returns 8 files: one archive per part + log
        assert [n for n, _ in todo].count("fig11-ne") == 1


def test_gpu_commands_measure_at_least_50_steps_with_nccl_defaults():
    for part in campaign.PARTS.values():
        for sweep in part.sweeps:
            argv = sweep.argv(4, Path("/x/out"), smoke=False)
            steps = int(argv[argv.index("--steps") + 1])
            warmup = int(argv[argv.index("--warmup") + 1])
            assert steps - warmup >= 50, (part.name, sweep.stem)
            assert "device=cpu" not in argv and "h200-21k" in argv
            assert sweep.points() >= 1
        assert part.sockets == part.name.startswith("sock")
    assert campaign.SOCKETS == {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def test_smoke_commands_are_tiny_and_on_cpu():
    argv = campaign.PARTS["fig9b"].sweeps[0].argv(8, Path("/x/o"), smoke=True)
    assert argv[argv.index("--vary") + 1] == "step_overlap=0,1"
    assert "device=cpu" in argv and argv[argv.index("--nproc") + 1] == "8"
    assert argv[argv.index("--max-uih") + 1] == "64"
    # exposed_comm.py's default step_overlap axis must not multiply the zipf sweep
    argv = campaign.PARTS["fig9c"].sweeps[0].argv(2, Path("/x/o"), smoke=False)
    varies = [argv[i + 1] for i, a in enumerate(argv) if a == "--vary"]
    assert varies == ["step_overlap=1", "zipf_alpha=1.2,1.6,1.8"]


def test_bad_part_names_are_one_line_errors(capsys):
    assert campaign.main(["run", "/tmp/never", "fig99@2"]) == 2
    assert "unknown part 'fig99'" in capsys.readouterr().err
    assert campaign.main(["run", "/tmp/never", "fig8b"]) == 2
    assert "needs a world size" in capsys.readouterr().err


def _row(**kw):
    exposed = dict.fromkeys(campaign_report.CATEGORIES, 0.0)
    exposed.update(kw.pop("exposed", {}))
    base = {"nproc": 2, "max_uih": 21000, "batch_size": 128, "mode": "freescale",
            "balance": "none", "step_ms": 100.0, "compute_ms_mean": 97.0, "qps": 2000.0,
            "straggler_pct": 1.0, "regime": "nvlink", "sweep": "fig11-fs"}  # fmt: skip
    return {**base, "exposed_comm_ms": exposed, **kw}


def test_collision_fit_recovers_a_line_and_skips_one_point():
    rows = [
        _row(sweep="fig9b-fs", step_overlap=str(x), collision_rows_pct=x,
             exposed={"emb_a2a": 0.5, "grad_a2a": 1.5 + 0.25 * x})
        for x in (0.0, 5.0, 10.0, 21.0)
    ] + [_row(sweep="fig9b-fs", nproc=4, collision_rows_pct=3.0)]  # fmt: skip
    fits = {f["nproc"]: f for f in campaign_report.collision_fit(rows)}
    assert fits[2]["slope_ms_per_pct"] == pytest.approx(0.25)
    assert fits[2]["intercept_ms"] == pytest.approx(2.0) and fits[2]["r2"] == pytest.approx(1.0)
    assert "slope_ms_per_pct" not in fits[4]


def test_fig11_efficiency_bubble_and_exposed_reduction():
    rows = [
        _row(nproc=1, mode="sync", sweep="fig11-w1", qps=1000.0),
        _row(nproc=4, mode="sync", sweep="fig11-base", qps=3600.0, exposed={"emb_a2a": 20.0}),
        _row(nproc=4, mode="freescale", qps=3880.0, step_ms=100.0, compute_ms_mean=98.0,
             exposed={"emb_a2a": 1.0, "grad_a2a": 1.0}),
        _row(nproc=1, mode="freescale", sweep="fig11-w1", qps=1000.0),
    ]  # fmt: skip
    _, table = campaign_report.fig11(rows)
    fs = next(t for t in table if t["nproc"] == 4 and t["mode"] == "freescale")
    assert fs["efficiency_pct"] == pytest.approx(97.0)
    assert fs["bubble_pct"] == pytest.approx(2.0)
    assert fs["exposed_below_sync_pct"] == pytest.approx(90.0)
    sync = next(t for t in table if t["nproc"] == 4 and t["mode"] == "sync")
    assert sync["efficiency_pct"] == pytest.approx(90.0)


def _run(tmp_path: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "benchmarks" / "campaign.py"), "run", str(tmp_path), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def _report(tmp_path: Path) -> dict:
    (md,) = tmp_path.glob("campaign-report-*.md")
    data = json.loads(md.with_suffix(".json").read_text())
    assert "## Fig. 8" in md.read_text() and "## Fig. 11" in md.read_text()
    return data


@pytest.mark.slow
def test_one_part_and_the_report_at_two_ranks(tmp_path):
    _run(tmp_path, "fig8b", "report", "--smoke", "--ranks", "2")
    assert (tmp_path / "fig8b-2cpu.tgz").exists() and not (tmp_path / "fig8b-2cpu").exists()
    data = _report(tmp_path)
    assert [(r["nproc"], r["balance"]) for r in data["fig8"]] == [(2, "cost")]


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("FREESCALE_CAMPAIGN_SMOKE"),
    reason="15-60 min per world size on 2 cores: set FREESCALE_CAMPAIGN_SMOKE=1 (not in CI)",
)
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_whole_campaign_smoke(tmp_path, ranks):
    """Every part at ``ranks`` gloo ranks, the report, and the simulator's
    re-validation (CPU runs listed there as skipped)."""
    _run(tmp_path, "all", "--smoke", "--ranks", str(ranks), "--date", "smoke", timeout=3600)
    for name, part in campaign.PARTS.items():
        assert (tmp_path / f"{name}-{campaign.tag(part.fixed_w or ranks, True)}.tgz").exists()
    data = _report(tmp_path)
    assert {r["mode"] for r in data["fig9"]} == {"sync", "sdd", "freescale"}
    assert {r["regime"] for r in data["fig11"]} == {"nvlink", "sockets"}
    assert any(r["efficiency_pct"] is not None for r in data["fig11"])
    assert set(data["ne"]["max_abs_loss_diff_vs_sync"]) == {"sync", "sdd", "freescale"}
    assert {b["regime"] for b in data["bandwidth"]} == {"nvlink", "sockets"}
    assert (tmp_path / f"fig10-{ranks}cpu.md").exists()
    val = json.loads((tmp_path / "sim-validation-smoke.json").read_text())
    assert any(f"-{ranks}cpu-steps" in s for s in val["skipped"])
