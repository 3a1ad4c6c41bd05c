"""Where the host's time goes in a training step (cProfile of one rank, world size 1).

At small batches the GPU idles because the host cannot launch fast enough
(benchmarks/overhead.py). This profiles the Python side of steps
``--from-step`` onwards (start-up and compilation excluded) and prints the
functions by own time and by cumulative time, per step.

    python benchmarks/host_profile.py --preset h200-21k --batch 32 --steps 40
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

import torch.distributed as dist

from freescale.pipeline.config import build_config
from freescale.pipeline.train import Trainer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="h200-21k")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--from-step", type=int, default=10)
    p.add_argument("--mode", default="sync")
    p.add_argument("--set", action="append", default=[], help="extra key=value")
    p.add_argument("--top", type=int, default=35)
    p.add_argument("--out", default="")
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29534")
    cfg = build_config(
        args.preset,
        [f"batch_size={args.batch}", f"steps={args.steps}", "warmup=2", f"mode={args.mode}",
         "nproc=1", "progress=false", *args.set],
    )  # fmt: skip
    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo", rank=0, world_size=1)
    trainer = Trainer(cfg)
    prof = cProfile.Profile()
    step = trainer._train_step

    def profiled_step(*a, **k):  # profiling starts at --from-step and runs to the end
        if trainer.liveness.step == args.from_step:
            prof.enable()
        return step(*a, **k)

    trainer._train_step = profiled_step  # type: ignore[method-assign]
    summary = trainer.run()
    prof.disable()
    steps = args.steps - args.from_step
    text = io.StringIO()
    head = f"# host profile: {args.preset} batch {args.batch} mode {args.mode}, {steps} steps"
    print(f"{head} profiled; step {summary['step_ms']:.1f} ms (GPU clock)", file=text)
    for key in ("tottime", "cumulative"):
        print(f"\n## by {key} (totals over {steps} steps)\n", file=text)
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats(key).print_stats(args.top)
    print(text.getvalue())
    if args.out:
        Path(args.out).write_text(text.getvalue())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
