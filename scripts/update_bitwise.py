"""The Triton sparse update of this tree vs the one of a git revision, bitwise.

A rewrite of `freescale.kernels.triton_update` that keeps the arithmetic
(only how run bounds are found, say) must give the same bits, not just the
same values to rounding. This runs both versions on seeded random cases
(duplicates, hot rows over several chunks, frozen slots, per-table scalars,
the skip flag, fp32 and bf16 weights, every optimizer and decay) and
compares the weights and optimizer state bit for bit. On a machine without
CUDA it runs Triton's interpreter (slow: ~1 s per case).

    python scripts/update_bitwise.py --base HEAD~1 --cases 150
    python scripts/update_bitwise.py --base-file old_triton_update.py  # no .git
    python scripts/update_bitwise.py --base-file old.py --time  # + GPU time of both
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load(rev: str, file: str | None):
    if file is not None:  # where the tree has no .git (the GPU machine's copy)
        src = Path(file).read_text()
    else:
        src = subprocess.run(
            ["git", "show", f"{rev}:freescale/kernels/triton_update.py"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
    path = Path(tempfile.mkdtemp()) / "base_update.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("base_update", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case(seed: int, device: str):
    import torch

    from freescale.embedding.optim import SGD, Adam, RowwiseAdagrad, make_state

    opts = [SGD(lr=0.1), RowwiseAdagrad(lr=0.05, initial_accumulator=0.1), Adam(lr=0.01),
            SGD(lr=0.1, weight_decay=0.3), RowwiseAdagrad(lr=0.05, weight_decay=0.2),
            RowwiseAdagrad(lr=0.05, weight_decay=0.2, weight_decay_mode="decoupled"),
            Adam(lr=0.01, weight_decay=0.5)]  # fmt: skip
    g = torch.Generator().manual_seed(seed)

    def pick(hi: int) -> int:
        return int(torch.randint(0, hi, (1,), generator=g))

    n, rows, dim = pick(200), 1 + pick(40), [1, 3, 8, 33][pick(4)]
    slots = torch.randint(0, rows, (n,), generator=g)
    hot = [0, 70, 200][pick(3)]
    if hot:
        slots = torch.cat([slots, torch.full((hot,), pick(rows))])
        slots = slots[torch.randperm(slots.numel(), generator=g)]
    grads = torch.randn(slots.numel(), dim, generator=g)
    weight = torch.randn(rows, dim, generator=g).to([torch.float32, torch.bfloat16][pick(2)])
    frozen = [[], [0], [0, rows // 2]][pick(3)]
    opt = opts[pick(len(opts))]
    kw = {"frozen": torch.tensor(frozen, dtype=torch.int64)}
    if pick(2):  # per-table scalars
        tables = 2 + pick(2)
        bounds = torch.sort(torch.randperm(max(rows, tables), generator=g)[: tables - 1]).values
        kw["table_bounds"] = bounds.clamp(min=1)
        kw["lr"] = torch.rand(tables, generator=g) * 0.1
        kw["bc"] = tuple(torch.rand(tables, generator=g) * 0.5 + 0.5 for _ in range(2))
    else:
        kw["lr"], kw["bc"] = 0.07, ((0.9, 0.99) if isinstance(opt, Adam) else (1.0, 1.0))
    kw["skip"] = [None, torch.tensor(True), torch.tensor(False)][pick(3)]
    state = make_state(opt, rows, dim, torch.device("cpu"))
    for t in state.values():
        t.add_(0.25)
    small_fan = bool(pick(2))

    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        return tuple(move(y) for y in x) if isinstance(x, tuple) else x

    args = {k: move(v) for k, v in kw.items()}
    return weight, state, slots, grads, opt, args, small_fan, device


def _run(module, case):
    weight, state, slots, grads, opt, args, small_fan, device = case
    w = weight.clone().to(device)
    st = [t.clone().to(device) for t in state.values()]
    fan = module.fan
    if small_fan:  # hot rows then take several tiles of pieces
        module.fan = lambda block_d: 2
    try:
        module.sparse_update(w, st, slots.to(device), grads.to(device), **opt.kernel_spec(),
                             **args)  # fmt: skip
    finally:
        module.fan = fan
    return [w.cpu(), *(t.cpu() for t in st)]


def _median_ms(update) -> tuple[float, float]:
    """(host ms to issue, GPU ms) of one `update()` call, medians of 20."""
    import torch

    for _ in range(3):
        update()
    torch.cuda.synchronize()
    host, gpu = [], []
    for _ in range(20):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        t0 = time.perf_counter()
        start.record()
        update()
        end.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end))
    return statistics.median(host), statistics.median(gpu)


def _time(modules: dict, device: str) -> list[dict]:
    """Host time to issue one update and GPU time per update, each version at
    training-like sizes (one table of 1e6 rows; 64k and 1M looked-up ids)."""
    import functools

    import torch

    from freescale.embedding.optim import Adam, RowwiseAdagrad, make_state

    rows_out = []
    g = torch.Generator(device=device).manual_seed(0)
    for opt in (RowwiseAdagrad(lr=0.05), Adam(lr=0.01)):
        for n, dim in ((65_536, 128), (1_048_576, 128)):
            weight = torch.randn(1_000_000, dim, device=device)
            state = list(make_state(opt, 1_000_000, dim, torch.device(device)).values())
            slots = torch.randint(0, 1_000_000, (n,), device=device, generator=g)
            grads = torch.randn(n, dim, device=device, generator=g)
            for name, module in modules.items():
                update = functools.partial(
                    module.sparse_update, weight, state, slots, grads, **opt.kernel_spec(),
                    lr=0.01, bc=(0.9, 0.99),
                )  # fmt: skip
                host, gpu = _median_ms(update)
                row = {"opt": type(opt).__name__, "ids": n, "dim": dim, "version": name,
                       "host_ms": round(host, 4), "gpu_ms": round(gpu, 4)}  # fmt: skip
                rows_out.append(row)
                print(json.dumps(row))
    return rows_out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="HEAD~1", help="git revision to compare with")
    parser.add_argument("--base-file", help="the base version as a file (instead of --base)")
    parser.add_argument("--cases", type=int, default=150)
    parser.add_argument("--time", action="store_true", help="also time both versions (CUDA)")
    args = parser.parse_args()
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, str(ROOT))
    from freescale.kernels import triton_update as here

    base = _load(args.base, args.base_file)
    if device == "cpu":
        from tests.kernels.conftest import _fix_interpreter_loop_bounds

        _fix_interpreter_loop_bounds()
    differ = []
    for seed in range(args.cases):
        case = _case(seed, device)
        a, b = _run(base, case), _run(here, case)
        same = all(
            x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))
            for x, y in zip(a, b, strict=True)
        )
        if not same:
            differ.append(seed)
        if (seed + 1) % 25 == 0:
            print(f"{seed + 1}/{args.cases} cases, {len(differ)} differ", file=sys.stderr)
    what = args.base_file or args.base
    if args.time and device == "cuda":
        _time({"base": base, "here": here}, device)
    print(f"{args.cases} cases on {device} vs {what}: {len(differ)} differ {differ[:10]}")
    print(json.dumps({"cases": args.cases, "device": device, "base": what, "differ": differ}))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
