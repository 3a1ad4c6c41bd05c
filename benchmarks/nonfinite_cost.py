"""GPU time the non-finite guard adds to a step, next to the step it guards.

The guard's work per step (`freescale.embedding.nonfinite`,
`freescale.pipeline.nonfinite`): isfinite over the gradients that reach the
tables, a one-element all-gather (world size 1 here: NCCL still runs it),
the norm of the dense gradients, and fused Adam in place of foreach Adam
(timed both ways: fused is what takes the device flag). Timed with CUDA
events (median) on a preset's shapes; compare with the step time of the same
preset (``--step-ms``, from a run of the same build).

    python benchmarks/nonfinite_cost.py --preset h200-21k --batch 64 --step-ms 95
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist

from freescale.comm import TorchCommunicator
from freescale.embedding.nonfinite import NonFiniteGuard
from freescale.jagged.schema import DataSchema
from freescale.pipeline.config import build_config
from freescale.pipeline.nonfinite import skip_flags
from freescale.pipeline.setup import build_model, make_source

sys.path.insert(0, str(Path(__file__).resolve().parent))
from interference import time_ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="h200-21k")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--step-ms", type=float, default=None)
    p.add_argument("--out", default=f"benchmarks/results/nonfinite-cost-{date.today()}")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    cfg = build_config(args.preset, ["device=cuda"])
    source = make_source(cfg)
    batch = source.batch(0, 0, 1, args.batch)
    ids = batch.uih.offsets[-1] + batch.candidates.offsets[-1]  # rows the tables see
    device = torch.device("cuda")
    grads = torch.randn(int(ids), cfg.dim, device=device)  # fp32, as the update receives them
    with device:
        model = build_model(cfg, DataSchema.standard(1000, 4))  # dense parameters only matter
    params = [p for p in model.parameters() if p.requires_grad]
    for q in params:
        q.grad = torch.randn_like(q)
    guard = NonFiniteGuard(TorchCommunicator(device=device))
    loss = torch.ones((), device=device)

    def guard_step() -> None:
        guard.begin_step(loss)
        guard.agree([grads], device)
        skip_flags(guard, params, device)

    fused = torch.optim.Adam(params, lr=1e-9, fused=True)
    foreach = torch.optim.Adam(params, lr=1e-9, foreach=True)
    fused.found_inf = torch.zeros((), device=device)  # type: ignore[attr-defined]
    times = {
        "guard (isfinite + all-gather + dense norm)": time_ms(guard_step, 30),
        "dense Adam, fused with found_inf": time_ms(fused.step, 30),
        "dense Adam, foreach (before)": time_ms(foreach.step, 30),
    }
    extra = times["guard (isfinite + all-gather + dense norm)"] + (
        times["dense Adam, fused with found_inf"] - times["dense Adam, foreach (before)"]
    )
    lines = [
        f"# Non-finite guard cost, {args.preset}, batch {args.batch}, {date.today()}",
        "",
        f"{int(ids)} gradient rows x {cfg.dim} (fp32); {sum(q.numel() for q in params)} dense "
        f"parameters; GPU {torch.cuda.get_device_name(0)}",
        "",
        "| work | ms |",
        "|---|---:|",
        *(f"| {k} | {v:.3f} |" for k, v in times.items()),
        f"| net added per step | {extra:.3f} |",
    ]
    result = {"times_ms": times, "added_ms": extra, "rows": int(ids)}
    if args.step_ms:
        result["step_ms"] = args.step_ms
        result["added_pct_of_step"] = 100.0 * extra / args.step_ms
        share = result["added_pct_of_step"]
        lines.append(f"| share of a {args.step_ms:.1f} ms step | {share:.2f}% |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(lines))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
