"""One HSTU attention point, fwd + bwd with and without the relative bias, for a
kernel profiler (issue 63, item 1): tunes and times both variants, prints each
compiled kernel's registers, spills and shared memory, then runs one step of
each between `cudaProfilerStart` / `Stop`, so that

    ncu --profile-from-start off --set full --import-source yes --clock-control none \
        -o REPORT python3 -m benchmarks.hstu_profile --point 6

profiles exactly the six kernels of those two steps (fwd, dq, dk/dv per
variant), not the tuning launches. ``--point`` indexes the points of
``scenarios/hstu-attention.toml``; ``--json`` writes the timings and kernel
resources.
"""

from __future__ import annotations

import argparse
import json
import tomllib

import torch
import triton

from freescale.kernels.attention import hstu as spec
from freescale.models import hstu_attention as hattn

from . import hstu
from .scenario import SCENARIOS


def kernel_resources() -> list[dict]:
    """Registers, spills and shared memory of every compiled HSTU kernel (Triton's cache)."""
    from freescale.kernels.attention import triton_hstu_bwd, triton_hstu_fwd

    out = []
    for fn in (
        triton_hstu_fwd._fwd_kernel,
        triton_hstu_bwd._dq_kernel,
        triton_hstu_bwd._dkdv_kernel,
    ):
        for cache in getattr(fn, "device_caches", {}).values():
            for key, k in cache[0].items():
                md = k.metadata
                out.append({"kernel": fn.fn.__name__, "regs": k.n_regs, "spills": k.n_spills,
                            "shared": md.shared, "warps": md.num_warps, "stages": md.num_stages,
                            "key": str(key)[-160:]})  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--point", type=int, default=6)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    points = tomllib.loads((SCENARIOS / "hstu-attention.toml").read_text())["params"]["points"]
    point = {"lengths": "h200-21k", **points[args.point]}
    x = hstu.make_inputs(hstu.jagged(point, "h200-21k"), point["heads"], point["head_dim"],
                         torch.bfloat16, "cuda", args.point)  # fmt: skip
    bias = hattn.RelativeBias().to("cuda")
    for t in bias.parameters():
        torch.nn.init.normal_(t, std=0.5)
    variants = [hstu.ours("bias", "fused", x, bias), hstu.ours("nobias", "fused", x, None)]
    states = [v.prepare() for v in variants]
    report = {"point": point, "pairs": x.shape.pairs, "tokens": x.packed[0].shape[0]}
    fwd_flops = 4 * point["head_dim"] * point["heads"] * x.shape.pairs
    for v, st in zip(variants, states, strict=True):
        v.step(st)  # tunes
        torch.cuda.synchronize()
        ms = triton.testing.do_bench(lambda v=v, st=st: v.step(st), warmup=25, rep=200,
                                     return_mode="median")  # fmt: skip
        report[v.name] = {"ms": ms, "tflops": 3.5 * fwd_flops / (ms * 1e-3) / 1e12}
        print(f"{v.name}: {ms:.2f} ms fwd+bwd, {report[v.name]['tflops']:.0f} TFLOP/s", flush=True)
    report["tuned"] = {str(k): v for k, v in spec._TUNED.items()}
    report["kernels"] = kernel_resources()
    for k in report["kernels"]:
        print(json.dumps(k), flush=True)
    print("tuned:", json.dumps(report["tuned"]), flush=True)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for v, st in zip(variants, states, strict=True):
        v.step(st)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
