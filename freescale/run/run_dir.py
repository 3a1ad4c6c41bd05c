"""A run directory (``output.dir``): one place for everything a run writes.

    runs/NAME/
      config.toml        the run's config, every path spelled out (`config_file`)
      metrics.jsonl      one JSON line per step (rank 0)
      summary.json       the summary line of `freescale train`
      checkpoints/       unless checkpoint.dir names another place
      trace-{rank}.json  when output.trace_steps asks for a profiler trace
      events.out.tfevents.*   output.tensorboard=true (`freescale.observe.board`)
      report.md, metrics.png  `freescale report runs/NAME`

`in_run_dir` fills the empty paths of a config from ``output.dir`` (paths
given explicitly win); the launcher then writes ``config.toml`` before any
rank starts and ``summary.json`` after the run. ``config.toml`` leaves
``checkpoint.resume`` out: ``freescale train --config runs/NAME/config.toml
--resume`` continues the run (appending to its metrics and events), and
the same command without ``--resume`` is refused instead of overwriting them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from freescale.config import TrainConfig

CONFIG = "config.toml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CHECKPOINTS = "checkpoints"
TRACE = "trace-{rank}.json"


def in_run_dir(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with its empty output paths (and checkpoint.dir) under ``output.dir``."""
    out = cfg.output
    if not out.dir:
        return cfg
    root = Path(out.dir)
    changes: dict[str, Any] = {}
    if not out.metrics_path:
        changes["output__metrics_path"] = str(root / METRICS)
    if not out.trace_path and out.trace_steps:
        changes["output__trace_path"] = str(root / TRACE)
    if not cfg.checkpoint.dir:
        changes["checkpoint__dir"] = str(root / CHECKPOINTS)
    return cfg.with_values(**changes) if changes else cfg


def check_run_dir(cfg: TrainConfig) -> None:
    """A fresh run (no resume) may not write over the run already in ``output.dir``."""
    if not cfg.output.dir or cfg.checkpoint.resume or cfg.eval_only:
        return
    if (Path(cfg.output.dir) / CONFIG).exists():
        raise ValueError(
            f"output.dir {cfg.output.dir} holds a run already: continue it with --resume, "
            "or choose another output.dir (or remove that one)"
        )


def write_config(cfg: TrainConfig) -> None:
    """``config.toml`` of the run (atomically: a crash leaves the old one or the new)."""
    from freescale.config.files import config_toml

    if not cfg.output.dir:
        return
    root = Path(cfg.output.dir)
    root.mkdir(parents=True, exist_ok=True)
    _write(root / CONFIG, config_toml(cfg.with_values(checkpoint__resume="")))


def write_summary(cfg: TrainConfig, summary: dict[str, Any]) -> None:
    if cfg.output.dir:
        _write(Path(cfg.output.dir) / SUMMARY, json.dumps(summary, indent=1) + "\n")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
