"""``freescale simulate`` end to end on the CPU (small sizes)."""

import json

import numpy as np
import pytest

from freescale.cli.main import main
from freescale.testing.tolerance import assert_within, regression_tol, sum_slack

SMALL = ["--steps", "4", "--batch-size", "8", "--length-median", "200", "--max-uih", "400"]


@pytest.mark.numeric
def test_simulate_prints_table_and_json_line(capsys):
    argv = ["simulate", "--world-sizes", "2,16", "--balance", "none,fbs,cost", *SMALL]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("| W | balance | mode |")
    result = json.loads(out[-1])
    rows = result["rows"]
    assert len(rows) == 2 * 3 * 3 and len(out) == 2 + len(rows) + 1
    assert "not calibrated" in result["calibration"]
    for r in rows:
        assert r["step_ms"] > 0 and r["qps"] > 0 and 0 <= r["straggler_pct"] < 100

    def get(w, balance, mode):
        return next(
            r for r in rows if (r["world_size"], r["balance"], r["mode"]) == (w, balance, mode)
        )

    for w in (2, 16):
        sync, fs = get(w, "none", "sync"), get(w, "none", "freescale")
        assert fs["step_ms"] <= sync["step_ms"]  # freescale blocks a subset of sync's comm
        # balancing with the model's own costs (no jitter) cannot raise the straggler %
        # (up to rounding: float64 percentages of sums over 8 samples x 5 features per rank)
        slack = sum_slack(8 * 5 * w, 100.0)
        assert get(w, "cost", "sync")["straggler_pct"] <= sync["straggler_pct"] + slack


def test_simulate_rejects_bad_arguments(capsys):
    assert main(["simulate", "--coef", "1,2", *SMALL]) == 2
    assert "--coef" in capsys.readouterr().err
    assert main(["simulate", "--modes", "async", *SMALL]) == 2
    with pytest.raises(SystemExit):
        main(["simulate", "--steps", "x"])


@pytest.mark.numeric
def test_calibrate_then_simulate_end_to_end(tmp_path, capsys):
    """freescale calibrate on step logs with rank_features, then freescale
    simulate --calibration with the file it wrote; both on the CPU in seconds."""
    rng = np.random.default_rng(0)
    logs, used, noise = [], [], []  # what the fit sees after the 2 warm-up steps
    for w in (1, 2):
        lines = []
        for step in range(14):
            feats = [
                [8.0, rng.uniform(1e3, 4e3), rng.uniform(1e6, 1e7), 20.0, 30.0] for _ in range(w)
            ]
            drawn = [rng.normal(0, 0.05) for _ in feats]
            compute = [
                5.0 + 1e-3 * f[1] + 1e-7 * f[2] + e for f, e in zip(feats, drawn, strict=True)
            ]
            if step >= 2:
                used += feats
                noise += drawn
            lines.append({"step": step, "compute_ms": compute, "rank_features": feats,
                          "exposed_comm_ms": {"ids_a2a": 0.1 * w, "emb_a2a": 0.3 * w},
                          "step_ms": max(compute) + 0.5, "items": 1})  # fmt: skip
        path = tmp_path / f"w{w}.jsonl"
        path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
        logs.append(str(path))
    cal = tmp_path / "cal.json"
    assert main(["calibrate", *logs, "--warmup", "2", "--out", str(cal)]) == 0
    fitted = json.loads(cal.read_text())
    # b and c within five standard errors of the noise drawn (the constant
    # feature columns only share the intercept among themselves).
    design = np.concatenate([np.ones((len(used), 1)), np.array(used)], axis=1)
    tol = regression_tol(design, np.array(noise))
    got = (fitted["compute"]["b"], fitted["compute"]["c"])
    assert_within(got, (1e-3, 1e-7), tol[2:4])
    assert fitted["fixed_ms"]["emb"] == pytest.approx(0.3)
    capsys.readouterr()
    out_json = tmp_path / "rows.json"
    argv = ["simulate", "--calibration", str(cal), "--world-sizes", "8,16", "--modes",
            "sync,freescale", "--json-out", str(out_json), *SMALL]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "cal.json" in result["calibration"]
    assert json.loads(out_json.read_text()) == result
    for r in result["rows"]:  # the W = 1 fixed exposure is in every step
        assert r["emb_ms"] >= 0.3 - sum_slack(4, r["emb_ms"]) or r["mode"] == "freescale"


def test_calibrate_refuses_logs_without_rank_features(tmp_path, capsys):
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({"step": 0, "compute_ms": [1.0]}) + "\n")
    assert main(["calibrate", str(path), "--warmup", "0", "--out", str(tmp_path / "c.json")]) == 2
    assert "rank_features" in capsys.readouterr().err
    assert main(["simulate", "--calibration", str(tmp_path / "missing.json"), *SMALL]) == 2
