"""Serving: the exported model (AOTInductor package) beside the eager eval forward.

The built-in sequence model of a preset (random weights: latency and memory
do not depend on them), exported once (`freescale.serving.export_model`,
dynamic shapes) and, off smoke, compiled into an AOTInductor package; then
per batch of the preset's data (``batch`` samples, ``batches`` of them after
``warmup``): latency of the eager eval forward (what training runs: varlen /
cuDNN attention on CUDA, under bf16 autocast where the preset trains with
``dense.amp=bf16``; ``amp`` in the params overrides) and of the served program
(exported with the same ``amp``) (the same attention
behind one op per pattern, `freescale.models.attention_op`; ``attention =
"padded"`` in the params: the padded fallback), the peak memory of each, and the largest
score difference against the eager forward, with the bound of the forward's
dtype (bf16 where the attention runs in bf16, `freescale.testing.tolerance`).

Smoke: the demo preset on the CPU, the `torch.export` program only (an
AOTInductor compile takes minutes on 2 cores).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from .runner import Ctx, Result
from .scenario import Scenario


def _timed(fn: Any, batches: list[Any], device: torch.device, warmup: int) -> tuple[float, float]:
    """(median ms per batch, peak GiB above what was allocated before)."""
    for b in batches[:warmup]:
        fn(b)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for b in batches[warmup:]:
        t0 = time.perf_counter()
        fn(b)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else 0.0
    return sorted(times)[len(times) // 2], peak


def measure(s: Scenario, ctx: Ctx) -> Result:
    from freescale.config import build_config
    from freescale.data.source import schema_of
    from freescale.pipeline.setup import build_model, make_source
    from freescale.serving import ExportError, export_model, load
    from freescale.serving.exporter import MANIFEST, run_amp
    from freescale.serving.loader import read_manifest
    from freescale.testing.tolerance import reduction_tol

    p = s.params
    device = torch.device(s.device if s.device != "any" else "cpu")
    cfg = build_config(p.get("preset", "h200-21k"), list(p.get("set", [])))
    source = make_source(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, schema_of(source)).to(device).eval()
    size, count, warmup = int(p["batch"]), int(p.get("batches", 10)), int(p.get("warmup", 3))
    batches = [source.batch(step, 0, 1, size).to(device) for step in range(count + warmup)]
    aoti = bool(p.get("aoti", True)) and not ctx.smoke
    t0 = time.perf_counter()
    attention = p.get("attention", "jagged")
    amp = run_amp(p.get("amp", "auto"), cfg, device.type)
    say = lambda m: print(m, flush=True)  # noqa: E731
    out, aoti_error = ctx.raw / "export", None
    try:
        export_model(model, batches[0], out, device=device.type, aoti=aoti,
                     attention=attention, amp=amp, say=say)  # fmt: skip
    except ExportError as e:  # the package failed, the program serves: measure it, say why
        if not (out / MANIFEST).is_file():
            raise
        aoti_error = read_manifest(out)["aoti_error"]
        say(f"measuring the torch.export program instead: {e}")
    export_s = time.perf_counter() - t0
    served = load(out, aoti=None if aoti_error is None else False)

    def eager(batch: Any) -> torch.Tensor:
        with torch.autocast(device.type, torch.bfloat16, enabled=amp == "bf16"):
            return model(batch).float()

    with torch.no_grad():
        eager_ms, eager_gib = _timed(eager, batches, device, warmup)
        served_ms, served_gib = _timed(served, batches, device, warmup)
        diffs = [(served(b) - eager(b)).abs().max().item() for b in batches[warmup:]]
    bf16 = device.type == "cuda" or amp == "bf16"  # the eager attention's dtype on CUDA
    dim = cfg.model.options.get("dim", 64)
    tol = reduction_tol(torch.bfloat16 if bf16 else torch.float32, 4 * dim, 1.0, 3)
    bound = tol["atol"] + tol["rtol"]
    row = {
        "device": device.type, "batch": size, "program": served.kind, "amp": amp,
        "export_s": round(export_s, 1), "eager_ms": round(eager_ms, 3),
        "served_ms": round(served_ms, 3), "speedup": round(eager_ms / served_ms, 3),
        "eager_peak_gib": round(eager_gib, 3), "served_peak_gib": round(served_gib, 3),
        "max_abs_diff": max(diffs), "tolerance": bound, "within_tolerance": max(diffs) <= bound,
        "aoti_error": aoti_error,
    }  # fmt: skip
    return Result([row])
