import json
import subprocess
import sys

from freescale.cli.main import main


def test_data_stats_prints_table_and_json_line(capsys):
    rc = main(
        [
            "data",
            "stats",
            "--max-uih",
            "20,80",
            "--batch-size",
            "8",
            "--world-size",
            "2",
            "--steps",
            "2",
            "--num-items",
            "5000",
            "--length-median",
            "40",
        ]
    )
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0
    assert "sparsity" in out[1]
    summary = json.loads(out[-1])
    assert [r["max_uih"] for r in summary["rows"]] == [20, 80]
    assert summary["rows"][0]["sparsity"] <= summary["rows"][1]["sparsity"]


def test_data_stats_on_a_sasrec_file(tmp_path, capsys):
    path = tmp_path / "seq.txt"
    path.write_text("".join(f"{u} {i}\n" for u in range(40) for i in range(u % 7 + 2)))
    rc = main(
        [
            "data",
            "stats",
            "--source",
            f"sasrec:{path}",
            "--max-uih",
            "3",
            "--batch-size",
            "4",
            "--world-size",
            "2",
        ]
    )
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # leave-one-out: histories of 2 (dropped) and 3 (evaluated only) give no training
    # sample; 28 users of 4..8 items give one each -> 3 whole global batches of 2x4
    assert out["steps"] == {"4": 3}
    assert out["split"] == {"users": 40, "eval_users": 34, "train_samples": 28, "users_dropped": 6}
    assert out["coverage"]["4"] == {"samples_read": 24, "fraction_read": 24 / 28}


def test_bad_arguments_give_one_clear_line():
    proc = subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", "data", "stats", "--source", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("freescale: error: unknown data source")
    assert "Traceback" not in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", "data", "stats", "--batch-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "positive integers" in proc.stderr
