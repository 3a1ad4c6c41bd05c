"""The small-table gradient and column sums (Triton) against torch, on one GPU.

Why they exist (issue 18): at UIH 2k, batch 32, the action embedding's torch
backward was ~30 kernels per step, and each bias gradient inside the dense
blocks' CUDA graphs a memset node plus a reduction. This checks the
replacements do not give back in kernel time what they save in idle time:
medians of `triton.testing.do_bench` (µs) and the bytes read per µs.

    python benchmarks/small_table.py --out benchmarks/results/small-table-1xH200.md
"""

from __future__ import annotations

import argparse
import sys

import torch

from freescale.kernels.linear import Linear
from freescale.kernels.small_table import column_sums, small_table_grad
from freescale.kernels.triton_common import bench_ms


def row(name: str, shape: str, nbytes: int, ours: float, torch_ms: float) -> list[str]:
    return [
        name, shape, f"{ours * 1e3:.1f}", f"{torch_ms * 1e3:.1f}", f"{torch_ms / ours:.2f}",
        f"{nbytes / (ours * 1e-3) / 1e9:.0f}",
    ]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    rows = []
    for t, c in ((60_000, 256), (60_000, 768), (600_000, 768), (256, 768)):
        x = torch.randn(t, c, device=dev, dtype=torch.bfloat16)
        ours, ref = bench_ms(lambda: column_sums(x)), bench_ms(lambda: x.sum(0))  # noqa: B023
        torch.testing.assert_close(column_sums(x).float(), x.float().sum(0), rtol=2e-2, atol=1)
        rows.append(row("column sums (bias grad)", f"{t}x{c} bf16", x.nbytes, ours, ref))
    for t, r in ((60_000, 4), (600_000, 4), (60_000, 32)):
        g = torch.randn(t, 256, device=dev)
        ids = torch.randint(0, r, (t,), device=dev)

        def theirs() -> torch.Tensor:
            return torch.ops.aten.embedding_dense_backward(g, ids, r, -1, False)  # noqa: B023

        ours = bench_ms(lambda: small_table_grad(g, ids, r))  # noqa: B023
        torch.testing.assert_close(small_table_grad(g, ids, r), theirs(), rtol=1e-4, atol=1e-2)
        rows.append(
            row(f"small table grad, {r} rows", f"{t}x256 fp32", g.nbytes, ours, bench_ms(theirs))
        )
    x = torch.randn(60_000, 256, device=dev, requires_grad=True)
    up = torch.randn(60_000, 768, device=dev, dtype=torch.bfloat16)
    for name, m in (("Linear", Linear(256, 768)), ("nn.Linear", torch.nn.Linear(256, 768))):
        m = m.to(dev)

        def step() -> None:
            with torch.autocast("cuda", torch.bfloat16):
                y = m(x)  # noqa: B023
            y.backward(up)

        ms = bench_ms(step)
        rows.append(
            [f"{name} fwd+bwd (autocast bf16)", "60000x256 -> 768", f"{ms * 1e3:.1f}", "", "", ""]
        )
    head = ["op", "shape", "ours µs", "torch µs", "torch / ours", "ours GB/s read"]
    lines = [f"| {' | '.join(r)} |" for r in [head, ["---"] * len(head), *rows]]
    text = (
        f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}\n\n" + "\n".join(lines) + "\n"
    )
    print(text, end="")
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
