"""The configuration by component: sections, their one-line errors, unknown
keys (the nearest key named), presets, --print-config and the keys the
README and docs use."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from freescale.api import with_settings
from freescale.config import (
    BUILTIN_MODEL,
    PRESETS,
    SECTIONS,
    TrainConfig,
    build_config,
    format_config,
)
from freescale.state.checkpoint import check_resumable
from freescale.state.checkpoint_files import FORMAT

ROOT = Path(__file__).resolve().parents[2]

PLACEHOLDER = re.compile(r"KEY|VALUE|NAME|\.\.\.|^key=|^section\.key=")


# ---- every section's validation: one line, naming section.key ------------------------
@pytest.mark.parametrize(
    "override,message",
    [
        ("run.mode=fast", "run.mode must be one of sync, sdd, freescale"),
        ("run.warmup=200", r"run.warmup \(200\) must be < run.steps"),
        ("run.timeout_s=0", "run.timeout_s must be a finite number >= 1"),
        ("run.peak_tflops=-1", "run.peak_tflops must be a finite number >= 0"),
        ("data.max_uih=0", "data: max_uih must be >= 1"),
        ("data.length_median=nan", "data.length_median must be a finite number"),
        ("data.step_overlap=2", r"data: step_overlap must lie in \[0, 1\]"),
        ("data.loader_workers=-2", "data.loader_workers must be -1"),
        ("model.heads=3", r"model dim \(32\) must be divisible by heads \(3\)"),
        ("model.attention=flash", "model attention must be one of auto, reference, varlen"),
        ("model.width=3", "model: unknown option"),
        ("model=nocolon", "must look like module:qualname"),
        ("data=nocolon", "data.source must be one of synthetic, sasrec, movielens, parquet"),
        ("embeddings.tables.item_emb.placement=disk", "placement must be one of device, host"),
        ("embeddings.optimizer=lamb", "embeddings.optimizer must be one of sgd"),
        ("embeddings.lr=0", "embeddings.lr must be a finite number > 0"),
        ("dense.graph_streams=3", "dense.graph_streams must be 1 or 2"),
        ("dense.amp=fp8", "dense.amp must be one of none, bf16"),
        ("balance=round", "balance.method must be one of none, fbs, vbs, cost, or your own"),
        ("balance.counts=variable", "balance.counts=variable needs balance.method=cost"),
        ("pipeline.comm_backend=nccl", "pipeline.comm_backend must be one of"),
        ("pipeline.prioritize=off", "pipeline.prioritize must be one of auto, on"),
        ("evaluation.batches=0", "evaluation.batches must be >= 1"),
        ("checkpoint.every=5", "checkpoint.every needs checkpoint.dir"),
        ("checkpoint.keep=0", "checkpoint.keep must be >= 1"),
        ("faults.nonfinite=ignore", "faults.nonfinite must be one of raise, skip"),
        ("faults.nan_steps=x", "faults.nan_steps must be comma-separated numbers"),
        ("faults.delay_compute_ms=-1", "faults.delay_compute_ms must be a finite number >= 0"),
        ("output.trace_steps=3", "output.trace_steps must look like '10-12'"),
        ("run.steps=many", "expects a int"),
        ("runs.steps=3", "unknown config key 'runs.steps'; did you mean 'run.steps'?"),
        ("steps=3", "unknown config key 'steps'; did you mean 'run.steps'?"),
        ("emb_lr=0.1", "unknown config key 'emb_lr'; did you mean 'embeddings.lr'?"),
        ("dim=64", "unknown config key 'dim'; did you mean 'model.dim'?"),
        ("stepz=3", "unknown config key 'stepz'; keys are section.key"),
    ],
)
def test_each_section_refuses_a_bad_value_in_one_line(override, message):
    with pytest.raises(ValueError, match=message) as e:
        build_config("demo", [override])
    assert "\n" not in str(e.value)


def test_a_check_across_sections_names_both_keys():
    with pytest.raises(ValueError, match=r"balance.max_local_batch must be 0 or >= run.batch_size"):
        build_config("demo", ["balance=cost", "balance.max_local_batch=4"])


def test_the_model_checks_its_own_options_once():
    """``dim % heads`` lives in the model's config only: the built-in factory's
    options are checked through it, another factory's are its own business."""
    src = "".join(p.read_text() for p in (ROOT / "freescale/config").glob("*.py"))
    assert "% self.heads" not in src and "dim %" not in src
    cfg = build_config("demo", ["model=examples.categories:build", "model.smoothing=0.1"])
    assert cfg.model.options == {"smoothing": 0.1}


def test_names_are_the_owning_packages():
    """The config keeps no list of names: a partitioner registered, a table
    optimizer or a comm backend added where it lives is one the config takes."""
    from freescale.balance import register_partitioner, registry
    from freescale.balance.fbs import identity
    from freescale.comm import BACKENDS
    from freescale.embedding.optim import OPTIMIZERS, SGD

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(registry, "_USER", {})  # (registered names last for the process)
        register_partitioner("stay_put", identity)
        assert build_config("demo", ["balance=stay_put"]).balance.method == "stay_put"
        mp.setitem(OPTIMIZERS, "plain_sgd", SGD)
        assert build_config("demo", ["embeddings.optimizer=plain_sgd"])
    for backend in BACKENDS:
        assert build_config("demo", [f"pipeline.comm_backend={backend}"])
    src = (ROOT / "freescale/config/sections.py").read_text()
    assert '"adagrad"' not in src.split("class EmbeddingsSection")[0]  # no copy of the list
    assert '"fbs"' not in src


# ---- sections, options, shorthands -----------------------------------------------------
def test_sections_keys_and_factory_options():
    cfg = build_config(
        "demo",
        ["run.mode=sdd", "data=sasrec:x.txt", "data.extra=[1, 2]", "model.dim=64",
         "balance=fbs", "dense.graphs=false", "embeddings.lr=0.1"],
    )  # fmt: skip
    # a data file's path is recorded absolutely: the run's records name it from anywhere
    assert cfg.run.mode == "sdd" and cfg.data.source == f"sasrec:{os.path.abspath('x.txt')}"
    assert cfg.data.options == {"extra": [1, 2]}
    assert cfg.model.factory == BUILTIN_MODEL
    assert cfg.model.options == {"dim": 64, "heads": 2, "layers": 1}
    assert cfg.balance.method == "fbs" and cfg.embeddings.lr == 0.1
    assert set(cfg.as_dict()) == set(SECTIONS)
    for name, cls in SECTIONS.items():
        assert isinstance(getattr(cfg, name), cls)
        assert dataclasses.fields(cls)  # frozen sections
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(getattr(cfg, name), dataclasses.fields(cls)[0].name, None)


def test_another_factory_drops_the_presets_builtin_options():
    cfg = build_config("demo", ["model.dim=8", "model=freescale.models.hstu:build"])
    assert cfg.model.options == {"dim": 8}


# ---- presets, print-config -------------------------------------------------------------
def test_presets_are_functions_returning_a_full_config():
    for name, preset in PRESETS.items():
        cfg = preset()
        assert isinstance(cfg, TrainConfig), name
        assert build_config(name) == cfg
    h200 = PRESETS["h200-21k"]()
    assert h200.data.max_uih == 21_000 and h200.model.options["dim"] == 256
    assert h200.dense.amp == "bf16" and h200.run.device == "cuda"


def test_print_config_is_grouped_by_section():
    text = format_config(build_config("demo"))
    headers = [line for line in text.splitlines() if line.startswith("[")]
    sections = [h for h in headers if ".options" not in h and ".tables" not in h]
    assert sections == [f"[{name}]" for name in SECTIONS]
    assert "[data.options]" in headers and "[model.options]" in headers  # TOML tables
    assert 'factory = "freescale.models.sequence:build"' in text


def test_round_trip_through_a_dict():
    cfg = build_config("h200-8k", ["data.x=1", "faults.nan_steps=3"])
    assert TrainConfig.from_dict(json.loads(json.dumps(cfg.as_dict()))) == cfg


# ---- checkpoints written before the sections ---------------------------------------------
OLD_FLAT_MANIFEST_CONFIG = {
    "mode": "sdd",
    "prioritize": "auto",
    "balance": "none",
    "plan_process": "auto",
    "balance_counts": "equal",
    "max_local_batch": 0,
    "nproc": 2,
    "device": "cpu",
    "comm_backend": "torch",
    "comm_overlapped": "",
    "steps": 20,
    "warmup": 1,
    "batch_size": 8,
    "seed": 0,
    "deterministic": True,
    "data": "synthetic",
    "data_options": {},
    "num_items": 2000,
    "max_uih": 64,
    "length_median": 24.0,
    "length_sigma": 0.8,
    "length_cap": 64,
    "zipf_alpha": 1.05,
    "step_overlap": 1.0,
    "max_candidates": 4,
    "max_content": 2,
    "samples_per_user": 1,
    "target_stride": 1,
    "shuffle": True,
    "eval_negatives": 100,
    "model": "",
    "model_options": {},
    "dim": 32,
    "item_dim": 32,
    "heads": 2,
    "layers": 1,
    "attention": "auto",
    "amp": "none",
    "dense_graphs": False,
    "dense_graph_streams": 2,
    "dense_lr": 0.003,
    "emb_optimizer": "adagrad",
    "emb_lr": 0.05,
    "assignment": "hashed",
    "eval_every": 0,
    "eval_batches": 4,
    "metrics_path": "",
    "trace_path": "",
    "trace_steps": "",
    "progress": False,
    "loader_workers": -1,
    "delay_compute_ms": 0.0,
    "delay_loader_ms": 0.0,
    "delay_ranks": "",
    "sync_debug": False,
    "checkpoint_dir": "ck",
    "checkpoint_every": 10,
    "checkpoint_keep": 2,
    "resume": "",
    "timeout_s": 300.0,
    "nonfinite": "raise",
    "nonfinite_max_skips": 3,
    "eval_only": False,
}  # fmt: skip  (a manifest written before the sections)


def test_a_checkpoint_from_before_the_sections_is_refused_in_one_line(tmp_path):
    ck = tmp_path / "step-00000010"
    ck.mkdir()
    manifest = {"format": FORMAT, "step": 10, "world_size": 2, "samples_seen": 160,
                "config": OLD_FLAT_MANIFEST_CONFIG, "files": {}}  # fmt: skip
    (ck / "manifest.json").write_text(json.dumps(manifest))
    cfg = build_config("demo", ["run.batch_size=8", "run.steps=30"])
    with pytest.raises(ValueError, match=r"a config holds the sections run, data, .*; got 'mode'"):
        check_resumable(str(tmp_path), cfg.as_dict(), verify=False)


def test_the_cli_names_the_nearest_key_of_a_removed_one():
    proc = subprocess.run(
        [sys.executable, "-m", "freescale.cli.main", "train", "--set", "steps=9", "--print-config"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "freescale: error: unknown config key 'steps'; did you mean 'run.steps'?"
    ]


def test_the_python_api_takes_sections_and_refuses_flat_keywords():
    base = build_config("demo")
    cfg = with_settings(base, {"run": {"steps": 7}, "model": {"dim": 16}, "data": {"x": 1}})
    assert cfg.run.steps == 7 and cfg.model.options["dim"] == 16 and cfg.data.options == {"x": 1}
    with pytest.raises(ValueError, match=r"unknown config key 'steps'; did you mean 'run\.steps'"):
        with_settings(base, {"steps": 7})
    with pytest.raises(AttributeError):
        base.batch_size  # noqa: B018  (sections only: base.run.batch_size)


# ---- the keys the README and docs use --------------------------------------------------
def _doc_keys() -> list[str]:
    """Every ``--set`` key of README.md and docs/ (the log is history: its
    commands are those of their day)."""
    docs = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p.name != "LOG.md"]
    pages = [ROOT / "README.md", *docs]
    found = set()
    for page in pages:
        for m in re.finditer(r"--set ([A-Za-z_.]+=[^\s`'\"]*)", page.read_text()):
            if not PLACEHOLDER.search(m.group(1)):
                found.add(m.group(1))
    return sorted(found)


@pytest.mark.parametrize("override", _doc_keys())
def test_every_key_of_the_readme_and_docs_builds_a_config(override):
    extra = ["checkpoint.dir=ck"] if "every" in override.split("=")[0] else []
    extra += ["balance=cost"] if override.startswith("balance.counts") else []
    extra += ["output.dir=runs/x"] if override.startswith("output.tensorboard") else []
    # the example model's option, shown with its factory
    extra += ["model=examples.categories:build"] if override.startswith("model.category") else []
    # a dynamic table's keys, shown beside its capacity
    table, _, key = override.split("=")[0].rpartition(".")
    extra += [f"{table}.capacity=1000"] if key in ("evict", "admit_after") else []
    build_config("demo", [*extra, override])
