"""``freescale simulate`` end to end on the CPU (small sizes)."""

import json

import pytest

from freescale.cli.main import main

SMALL = ["--steps", "4", "--batch-size", "8", "--length-median", "200", "--max-uih", "400"]


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
        assert get(w, "cost", "sync")["straggler_pct"] <= sync["straggler_pct"] + 1e-9


def test_simulate_rejects_bad_arguments(capsys):
    assert main(["simulate", "--coef", "1,2", *SMALL]) == 2
    assert "--coef" in capsys.readouterr().err
    assert main(["simulate", "--modes", "async", *SMALL]) == 2
    with pytest.raises(SystemExit):
        main(["simulate", "--steps", "x"])
