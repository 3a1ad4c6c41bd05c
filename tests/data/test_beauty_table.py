"""scripts/beauty_table.py: its runs are valid configurations (keys renamed elsewhere
must be renamed in its `KEYS` too) and its report reads summaries."""

import importlib.util
import json
from pathlib import Path

import pytest

from freescale.config import build_config

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("beauty_table", ROOT / "scripts/beauty_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["reference", "hstu", "categories"])
def test_every_run_is_a_valid_config(name):
    bt = _script()
    argv = bt.command(bt.settings(name, Path("b.txt"), Path("b.parquet")))
    overrides = [argv[i + 1] for i in range(len(argv)) if argv[i] == "--set"]
    cfg = build_config("demo", overrides)
    assert cfg.run.mode == "sync" and cfg.run.nproc == 2 and cfg.run.device == "cpu"


def test_report_marks_who_beats_popularity(tmp_path):
    bt = _script()
    pop = {"hr@10": 0.3, "ndcg@10": 0.15}
    rows = {
        "reference": {"test": {"hr@10": 0.4, "ndcg@10": 0.2}, "valid": pop, "wall_s": 10.0},
        "hstu": {"test": {"hr@10": 0.35, "ndcg@10": 0.1}, "valid": pop, "wall_s": None},
    }
    counts = {"users": 3, "eval_users": 3, "train_samples": 9, "users_dropped": 0}
    bt.report(tmp_path / "t", rows, pop, counts, ["cmd"], Path("b.txt"), "abc")
    record = json.loads((tmp_path / "t.json").read_text())
    assert record["beats_popularity"] == {"reference": True, "hstu": False}
    md = (tmp_path / "t.md").read_text()
    assert "| reference | 0.4000 | 0.2000 |" in md and "| hstu | 0.3500 | 0.1000 |" in md
    assert "commit: abc" in md and "cmd" in md


def test_gpu_attention_runs_are_valid_configs():
    bt = _script()
    argv = bt.command(bt.settings("hstu-fused-s1", Path("b.txt"), Path("p"), True, 64), True)
    assert argv[1:4] == ["-m", "freescale.cli.main", "train"]
    overrides = [argv[i + 1] for i in range(len(argv)) if argv[i] == "--set"]
    cfg = build_config("demo", overrides)
    assert cfg.run.device == "cuda" and cfg.run.nproc == 1 and cfg.run.batch_size == 128
    assert cfg.run.seed == 1 and cfg.model.options == {**cfg.model.options, "attention": "fused"}
    assert cfg.model.options["dim"] == 64


def test_spread_verdicts_against_the_last_attentions_two_seeds():
    bt = _script()

    def run(hr, ndcg):
        return {"test": {"hr@10": hr, "ndcg@10": ndcg}}

    rows = {"hstu-fused-s0": run(0.41, 0.25), "hstu-fused-s1": run(0.47, 0.25),
            "hstu-padded-s0": run(0.40, 0.25), "hstu-padded-s1": run(0.42, 0.25)}  # fmt: skip
    got = {(v["seed"], v["metric"]): v for v in bt.spread_verdicts(rows, 10_000)}
    margin = 2 * (0.41 * 0.59 / 10_000) ** 0.5
    assert got[("0", "hr@10")]["within"]
    assert got[("0", "hr@10")]["margin"] == pytest.approx(margin)
    assert not got[("1", "hr@10")]["within"]  # 0.05 > 0.02 + 0.0098
    assert got[("1", "ndcg@10")]["within"]
    assert bt.spread_verdicts({"hstu-fused-s0": run(0.4, 0.2)}, 10) == []
