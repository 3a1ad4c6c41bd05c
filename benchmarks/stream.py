"""Streaming data: peak memory per rank vs dataset size, and the loader's rate on a GPU.

Datasets are generated, not committed: ``scripts/make_taste_data.py DIR --files
K`` (sharded Parquet in the ``parquet-stream`` layout), once per dataset into
``params.data_dir`` (default: a folder under the raw output) and reused.

``memory`` runs (``params.runs``: [dataset, reader]) are ``freescale train``
commands in a child process; the child's process tree is sampled every
``params.sample_s`` from ``/proc``: per rank (a spawned rank and its loader
workers), the peak of the summed PSS (shared pages split between the
processes that map them, so torch's libraries are not counted once per
process) and of the summed RSS. ``reader = "parquet"`` is the in-memory
reader on one file of the same rows (its comparison row).

``rate`` (``params.rate``, GPU): the loader stage alone
(`freescale.pipeline.loader.Prefetcher` as the trainer builds it: default
worker count, packed batches, copies to the device) over the steps of one
training run at the preset on a ``parquet-stream`` dataset, then that run
(step time, data wait from its summary): the loader's batches/s over the
trainer's steps/s is ``loader_vs_step``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .runner import Ctx, Result
from .scenario import Scenario

ROOT = Path(__file__).resolve().parent.parent
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


def make_dataset(folder: Path, spec: dict[str, Any]) -> dict[str, Any]:
    """Generate ``spec`` (users, items, median_len, max_len, files, row_group) into
    ``folder`` unless its ``meta.json`` says it is there already."""
    meta = folder / "meta.json"
    if meta.exists() and json.loads(meta.read_text()).get("spec") == spec:
        return json.loads(meta.read_text())
    args = [sys.executable, str(ROOT / "scripts/make_taste_data.py"), str(folder / "parts")]
    for key in ("users", "items", "median_len", "max_len", "files", "row_group"):
        args += [f"--{key.replace('_', '-')}", str(spec[key])]
    start = time.perf_counter()
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    info = {**json.loads(out.strip().splitlines()[-1]), "spec": spec}
    info["generate_s"] = round(time.perf_counter() - start, 1)
    info["bytes"] = sum(p.stat().st_size for p in (folder / "parts").glob("*.parquet"))
    meta.write_text(json.dumps(info))
    return info


def one_file(folder: Path) -> Path:
    """The dataset's rows as one Parquet file (the in-memory reader reads a file)."""
    import pyarrow.parquet as pq

    path = folder / "all.parquet"
    if not path.exists():
        parts = sorted((folder / "parts").glob("*.parquet"))
        schema = pq.read_schema(parts[0])
        with pq.ParquetWriter(path, schema) as writer:
            for p in parts:
                writer.write_table(pq.read_table(p, schema=schema))
    return path


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _descendants(pid: int, tree: dict[int, list[int]]) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += tree.get(p, [])
    return out


def _memory_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of a process in kB; (0, 0) once it is gone."""
    try:
        pss = next(
            int(line.split()[1])
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
            if line.startswith("Pss:")
        )
        rss = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_KB
    except (OSError, StopIteration, ValueError):
        return 0, 0
    return pss, rss


def _is_rank(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"spawn_main" in cmd and b"resource_tracker" not in cmd


def sampled_run(cmd: list[str], every_s: float, log: Path) -> tuple[int, dict[int, tuple]]:
    """Run ``cmd``; per rank (by first sight), peak (PSS MB, RSS MB) of its process tree."""
    peaks: dict[int, tuple[float, float]] = {}
    ranks: list[int] = []
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        while proc.poll() is None:
            tree = _children()
            for pid in _descendants(proc.pid, tree)[1:]:
                if pid not in ranks and _is_rank(pid):
                    ranks.append(pid)
            for pid in ranks:
                sizes = [_memory_kb(p) for p in _descendants(pid, tree)]
                pss, rss = sum(s[0] for s in sizes) / 1024, sum(s[1] for s in sizes) / 1024
                old = peaks.get(pid, (0.0, 0.0))
                peaks[pid] = (max(old[0], pss), max(old[1], rss))
            time.sleep(every_s)
    return proc.returncode, {k: peaks[pid] for k, pid in enumerate(ranks)}


def memory_row(s: Scenario, ctx: Ctx, data: Path, dataset: str, reader: str) -> dict[str, Any]:
    p = s.params
    info = make_dataset(data / dataset, p["datasets"][dataset])
    path = data / dataset / "parts" if reader == "parquet-stream" else one_file(data / dataset)
    slug = f"{dataset}-{reader}"
    metrics = ctx.raw / f"{slug}.jsonl"
    sets = [*p["common"], f"data={reader}:{path}", f"output.metrics_path={metrics}"]
    cmd = [sys.executable, "-m", "freescale.cli.main", "train", "--preset", p["preset"]]
    cmd += [x for kv in sets for x in ("--set", kv)]
    start = time.perf_counter()
    rc, peaks = sampled_run(cmd, p.get("sample_s", 0.25), ctx.raw / f"{slug}.log")
    wall = time.perf_counter() - start
    if rc != 0:
        tail = (ctx.raw / f"{slug}.log").read_text()[-2000:]
        raise RuntimeError(f"{slug}: freescale train exited {rc}:\n{tail}")
    steps = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    timed = [x for x in steps if x["step"] >= 10] or steps
    return {
        "case": slug,
        "point": {"dataset": dataset, "reader": reader},
        "dataset": dataset,
        "reader": reader,
        "events": info["events"],
        "files": info["files"],
        "row_groups": info["row_groups"],
        "data_mb": round(info["bytes"] / 2**20, 1),
        "steps": len(steps),
        "ranks": len(peaks),
        "rank_peak_pss_mb": round(max(v[0] for v in peaks.values()), 1),
        "rank_peak_rss_mb": round(max(v[1] for v in peaks.values()), 1),
        "step_ms": round(sum(x["step_ms"] for x in timed) / len(timed), 2),
        "wall_s": round(wall, 1),
    }


def judge_memory(rows: list[dict[str, Any]], limit_mb: float, flat: float) -> None:
    """``memory_ok`` (streamed rows: peak PSS within the limit) and ``flat_ok``
    (streamed rows of a larger dataset: within ``flat`` of the smallest's peak)."""
    rows = [r for r in rows if "reader" in r]
    streamed = [r for r in rows if r["reader"] == "parquet-stream"]
    small = min(streamed, key=lambda r: r["events"]) if streamed else None
    for r in rows:
        ours = r["reader"] == "parquet-stream"
        r["memory_ok"] = r["rank_peak_pss_mb"] <= limit_mb if ours else None
        r["vs_smallest"] = round(r["rank_peak_pss_mb"] / small["rank_peak_pss_mb"], 3)
        r["flat_ok"] = r["vs_smallest"] <= flat if ours and r is not small else None


def rate_row(s: Scenario, ctx: Ctx, data: Path) -> dict[str, Any]:
    """One GPU training run on streamed data, then its loader stage alone."""
    import torch

    from freescale.config import build_config
    from freescale.pipeline.loader import Prefetcher, default_workers, steps_per_read
    from freescale.pipeline.setup import make_source
    from freescale.run.launch import launch

    from .train import single_rank

    p = s.params
    info = make_dataset(data / p["rate"], p["datasets"][p["rate"]])
    spec = f"parquet-stream:{data / p['rate'] / 'parts'}"
    metrics = ctx.raw / "rate.jsonl"
    sets = [*p["common"], f"data={spec}", f"output.metrics_path={metrics}"]
    cfg = build_config(p["preset"], sets)
    # The loader alone first: workers forked after a training run in this process
    # would inherit (and free) its CUDA objects.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    workers = cfg.data.loader_workers
    workers = default_workers(device) if workers < 0 else workers
    source = make_source(cfg.data, cfg.run.seed)  # the trainer's own source
    steps = range(cfg.run.steps)
    loader = Prefetcher(source, 0, 1, cfg.run.batch_size, device, steps, workers=workers)
    loader.get()  # workers started, first windows read
    start, n = time.perf_counter(), 0
    try:
        while True:
            loader.get()
            n += 1
    except StopIteration:
        pass
    loader_ms = (time.perf_counter() - start) * 1000 / max(n, 1)
    loader.close()
    del loader
    with single_rank():
        summary = launch(cfg)
    assert summary is not None
    step_ms = summary["step_ms"]
    group = steps_per_read(source, cfg.run.batch_size, workers)
    return {
        "case": f"{p['preset']} b{cfg.run.batch_size} {p['rate']}",
        "point": {"dataset": p["rate"]},
        "events": info["events"],
        "files": info["files"],
        "loader_workers": workers,
        "steps_per_read": group,
        "step_ms": round(step_ms, 2),
        "data_wait_ms": summary.get("data_wait_ms"),
        "data_wait_ms_max": summary.get("data_wait_ms_max"),
        "loader_ms_per_batch": round(loader_ms, 2),
        "loader_vs_step": round(step_ms / loader_ms, 2),
    }


def measure(s: Scenario, ctx: Ctx) -> Result:
    p = s.params
    data = Path(p["data_dir"]) if p.get("data_dir") else ctx.raw / "data"
    data.mkdir(parents=True, exist_ok=True)
    rows = []
    if p.get("rate"):
        rows.append(rate_row(s, ctx, data))
        print(json.dumps(rows[-1]), flush=True)
    for dataset, reader in p.get("runs", []):
        rows.append(memory_row(s, ctx, data, dataset, reader))
        print(json.dumps(rows[-1]), flush=True)
    if p.get("runs"):
        judge_memory(rows, p.get("limit_mb", 1536.0), p.get("flat", 1.10))
    sections = [
        "Peak memory per rank: the rank process and its loader workers, sampled from "
        "/proc (PSS: shared pages split among the processes mapping them; RSS counts "
        "them in every process). Data generated by scripts/make_taste_data.py."
    ]
    return Result(rows, sections, [])
