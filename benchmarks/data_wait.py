"""Does the loader stay ahead, and does data wait measure GPU starvation? (world size 1)

1. The loader alone: batches/s of the real `Prefetcher` (worker processes,
   pinning, host-to-device copy) for the preset, per worker count, against
   the training step rate measured below (target: >= 3x).
2. Training at world size 1 with an injected loader delay (`delay_loader_ms`):
   none; half a step (the loader is slower than usual but still ahead: the
   GPU must not starve, compute must not change); a step + ``--extra`` ms
   (the GPU must starve for about ``extra`` per step, compute unchanged).

Prints a table, writes markdown, ends with one JSON line; exits 1 if a check
fails, so a GPU session stops on it.

    python benchmarks/data_wait.py --preset h200-21k --batch 128
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

from freescale.pipeline.balancing import host_lengths
from freescale.pipeline.config import build_config
from freescale.pipeline.launch import launch
from freescale.pipeline.loader import Prefetcher, default_workers
from freescale.pipeline.setup import make_source


def loader_rate(cfg, workers: int, batches: int, device: torch.device) -> float:
    """Batches/s that the loader hands to a consumer that takes no time."""
    source = make_source(cfg)
    steps = range(batches + 4)
    loader = Prefetcher(
        source, 0, cfg.nproc, cfg.batch_size, device, steps, host_lengths=host_lengths,
        workers=workers,
    )  # fmt: skip
    try:
        for _ in range(4):  # start-up: workers fork, first batches
            loader.get()
        start = time.perf_counter()
        for _ in range(batches):
            loader.get()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return batches / (time.perf_counter() - start)
    finally:
        loader.close()


def train(preset: str, overrides: list[str], path: Path) -> dict:
    cfg = build_config(preset, [*overrides, f"metrics_path={path}", "progress=false"])
    summary = launch(cfg)
    assert summary is not None
    steps = [json.loads(x) for x in path.read_text().splitlines()]
    measured = [s for s in steps if s["step"] >= cfg.warmup]
    return {
        "step_ms": statistics.median(s["step_ms"] for s in measured),
        "compute_ms": statistics.median(s["compute_ms"][0] for s in measured),
        "data_wait_ms": statistics.mean(s["data_wait_ms"] for s in measured),
        "summary_step_ms": summary["step_ms"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="h200-21k")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--max-uih", type=int, default=None)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--workers", default="0,1,2,4", help="loader worker counts to time")
    p.add_argument("--extra", type=float, default=50.0, help="ms the slow loader lags a step")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--out", default=f"benchmarks/results/data-wait-{date.today()}")
    args = p.parse_args()
    out = Path(args.out)
    raw = out.parent / f"{out.name}-steps"
    raw.mkdir(parents=True, exist_ok=True)
    common = [
        *args.overrides, "nproc=1", f"batch_size={args.batch}", f"steps={args.steps}",
        f"warmup={args.warmup}", "eval_every=0",
        *([f"max_uih={args.max_uih}"] if args.max_uih else []),
    ]  # fmt: skip
    cfg = build_config(args.preset, common)
    device = torch.device("cuda" if cfg.device == "cuda" else "cpu")

    base = train(args.preset, common, raw / "delay0.jsonl")
    step = base["step_ms"]
    step_rate = 1000.0 / step
    workers = [int(w) for w in args.workers.split(",")]
    auto = default_workers(device)
    rates = {w: loader_rate(cfg, w, 16, device) for w in sorted({*workers, auto})}
    half = round(0.5 * step, 1)
    slow = round(step + args.extra, 1)
    runs = {
        0.0: base,
        half: train(args.preset, [*common, f"delay_loader_ms={half}"], raw / "delay-half.jsonl"),
        slow: train(args.preset, [*common, f"delay_loader_ms={slow}"], raw / "delay-slow.jsonl"),
    }
    checks = {
        "no delay: data wait <= 1 ms": base["data_wait_ms"] <= 1.0,
        f"loader (auto, {auto} workers) >= 3x step rate": rates[auto] >= 3 * step_rate,
        "half-step delay: data wait <= 1 ms": runs[half]["data_wait_ms"] <= 1.0,
        "half-step delay: compute within 3%": abs(runs[half]["compute_ms"] / base["compute_ms"] - 1)
        <= 0.03,
        "slow loader: data wait = delay - step (+-25%)": abs(
            runs[slow]["data_wait_ms"] - (slow - step)
        )
        <= 0.25 * (slow - step),
        "slow loader: compute within 3%": abs(runs[slow]["compute_ms"] / base["compute_ms"] - 1)
        <= 0.03,
    }
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    lines = [
        "# Data wait as GPU starvation, and the loader's rate (world size 1)", "",
        f"- date: {date.today()}",
        f"- machine: {gpu}, torch {torch.__version__}, {args.preset}, batch {args.batch}",
        f"- command: `python {' '.join(sys.argv)}`", "",
        "| loader workers | batches/s | x step rate |", "|---|---|---|",
        *(f"| {w}{' (auto)' if w == auto else ''} | {r:.2f} | {r / step_rate:.2f} |"
          for w, r in rates.items()),
        "", f"Step rate without delay: {step_rate:.2f} steps/s ({step:.1f} ms median step).", "",
        "| loader delay ms | step ms (median) | compute ms (median) | data wait ms (mean) |",
        "|---|---|---|---|",
        *(f"| {d} | {r['step_ms']:.2f} | {r['compute_ms']:.2f} | {r['data_wait_ms']:.3f} |"
          for d, r in runs.items()),
        "", "| check | result |", "|---|---|",
        *(f"| {name} | {'pass' if ok else 'FAIL'} |" for name, ok in checks.items()),
    ]  # fmt: skip
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({
        "benchmark": "data_wait", "step_ms": step, "loader_batches_per_s": rates,
        "runs": {str(d): r for d, r in runs.items()}, "checks": checks,
    }))  # fmt: skip
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
