"""Digests of short CPU training runs, to show a change left every number alone.

Host-overhead work (fewer ops per step) must not change any value. This
trains the demo preset shaped like the H200 model (dim 256, 4 heads, 4 layers) on 1 and
2 gloo ranks in each mode and prints, per run, a SHA-256 of the per-step
losses, of the final item table with its optimizer state, and of the dense
weights. Run it before and after a change: equal digests = bit-identical runs.

    python scripts/run_digest.py > before.txt   # ... change ..., then again
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from typing import Any

import torch

from freescale.config import build_config
from freescale.pipeline.train import Trainer
from freescale.testing import run_ranks

SHAPE = ["model.dim=256", "model.heads=4", "model.layers=4", "run.batch_size=16"]


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _run(overrides: list[str]) -> dict[str, Any]:
    trainer = Trainer(build_config("demo", [*overrides, "output.progress=false"]))
    trainer.run()
    losses = [s["loss"] for s in trainer.summary.steps]
    state = trainer.embeddings.full_optimizer_state("item_emb")
    return {
        "losses": hashlib.sha256(struct.pack(f"{len(losses)}d", *losses)).hexdigest()[:16],
        "last_loss": losses[-1],
        "table": _digest([trainer.embeddings.full_table("item_emb")]),
        "opt_state": _digest([state[k] for k in sorted(state)]),
        "dense": _digest([p for _, p in sorted(trainer.model.named_parameters())]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--modes", default="sync,sdd,freescale")
    args = p.parse_args()
    for world in (int(w) for w in args.worlds.split(",")):
        for mode in args.modes.split(","):
            overrides = [
                *SHAPE, f"run.steps={args.steps}", "run.warmup=1", "evaluation.every=4",
                f"run.mode={mode}", f"run.nproc={world}",
            ]  # fmt: skip
            out = run_ranks(_run, world, overrides, timeout=600)
            print(json.dumps({"world": world, "mode": mode, **out[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
