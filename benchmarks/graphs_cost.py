"""GPU time of the block stack's forward + backward: eager vs padded vs graphed.

`dense_graphs=true` cut host time per step but made the UIH-21k step's GPU
work longer (docs/LOG.md). This times, on one batch shaped like the h200
presets (lognormal lengths, 32 samples, model dim 256, 4 heads, 4 layers,
bf16 autocast), the stack's forward + backward as the model runs it eagerly,
the padded body (`PaddedBlocks`) run eagerly with the exact and with a
ceiling maximum, and the captured graph; so the extra time can be pinned on
padding, the masks, the maxima, or the capture.

    python benchmarks/graphs_cost.py --max-uih 21000 --reps 20
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from freescale.jagged.ops import lengths_to_offsets
from freescale.models.attention import attention_layout, segments
from freescale.models.sequence import Block, ModelConfig
from freescale.pipeline.graphs import BlockGraphs, PaddedBlocks, bucket, padded_inputs


def timed(fn, reps: int) -> float:
    """Mean ms of ``fn`` (forward + backward), after two warm-up calls."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-uih", type=int, default=21000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--ceiling", type=int, default=0, help="max UIH of the padded/graph runs")
    args = p.parse_args()
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(np.log(4500), 0.55, args.batch).astype(int), 17000)
    lengths = np.minimum(lengths, args.max_uih)
    cands = rng.integers(1, 9, args.batch)
    dev = torch.device("cuda")
    uo = lengths_to_offsets(torch.tensor(lengths)).to(dev)
    co = lengths_to_offsets(torch.tensor(cands)).to(dev)
    n_u, n_c, dim = int(lengths.sum()), int(cands.sum()), 256
    cfg = ModelConfig(dim=dim, heads=4, layers=4)
    blocks = torch.nn.ModuleList(Block(cfg) for _ in range(cfg.layers)).to(dev)
    uih = torch.randn(n_u, dim, device=dev, requires_grad=True)
    cand = torch.randn(n_c, dim, device=dev, requires_grad=True)
    max_u, max_c = int(lengths.max()), int(cands.max())
    ceiling = args.ceiling or bucket(max_u)
    amp = torch.autocast("cuda", dtype=torch.bfloat16)

    def backward(out: torch.Tensor) -> None:
        out.float().sum().backward()
        uih.grad = cand.grad = None
        blocks.zero_grad(set_to_none=True)

    def eager() -> None:
        with amp:
            su, sc = segments(uo, "varlen", max_u), segments(co, "varlen", max_c)
            layout = (attention_layout(su, su, True, n_u), attention_layout(sc, su, False, n_c))
            u, c = uih, cand
            for block in blocks:
                u, c = block(u, c, layout)
        backward(c)

    def padded(max_len: int):
        def run() -> None:
            with amp:
                _, args_ = padded_inputs(uih, cand, uo, co)
                out = PaddedBlocks(blocks, max_len, bucket(max_c))(*args_)[:n_c]
            backward(out)

        return run

    graphs = BlockGraphs(blocks)
    graphs.max_uih = ceiling

    def graphed() -> None:
        with amp:
            out = graphs.run(uih, cand, uo, co, max_u, max_c)
        backward(out)

    result = {
        "tokens": n_u, "candidates": n_c, "max_uih": max_u, "ceiling": ceiling,
        "eager_ms": timed(eager, args.reps),
        "padded_exact_max_ms": timed(padded(max_u), args.reps),
        "padded_ceiling_ms": timed(padded(ceiling), args.reps),
        "graphed_ms": timed(graphed, args.reps),
    }  # fmt: skip
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
