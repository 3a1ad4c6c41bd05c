"""The cuDNN attention backend on one GPU: the op, a training A/B, the losses.

Three parts, ~5 minutes on an H200 (``--skip op,train,losses`` drops some):

1. op: the model's causal self-attention call (`attention.attend`, bf16, 4
   heads of 64) on the h200-21k batch of `scripts/gpu_attention_probe.py`
   (its batch builder), cudnn vs varlen, fwd and fwd+bwd (CUDA events,
   median), on both row layouts: three contiguous tensors (the probe's) and
   three views of one (T, 3·H·D) projection (the model's; cuDNN reads them
   in place, ``cudnn-copies`` makes them contiguous first). Max relative
   difference of O, dQ, dK, dV to varlen's; the graphs built and their engines.
2. train: ``freescale train --preset h200-21k --set run.nproc=1
   run.batch_size=128 model.attention=varlen|cudnn run.steps=40
   run.warmup=20``, step_ms (and TFLOP/s, MFU) from each summary.
3. losses: 200 steps at batch 32, UIH 2k (the h200-8k preset, data.max_uih=2000):
   varlen seeds 0 and 1, cudnn seed 0 and varlen seed 0 again; per step
   |loss_cudnn - loss_varlen0| against |varlen0 - varlen1| (the acceptance:
   within the spread of two seeds of the old path) and against the varlen
   rerun (same seed: only the kernels' nondeterminism).

    PYTHONPATH=/tmp/site:. python3 scripts/gpu_cudnn_attention.py

Results go to stdout and, when ``OUT`` is set, to ``$OUT/cudnn_attention.json``.

CPU: ``--cpu-check`` validates and lowers the graphs (`freescale.models.
cudnn_graphs`) for sm90 with the real frontend and no device (see the
probe's docstring: a cp312 frontend, a libcudnn and a libcuda.so.1 stub on
LD_LIBRARY_PATH); ``--cpu-smoke`` runs parts 2 and 3 as tiny CPU runs
(demo preset, reference vs auto) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHECK_SPECS = [  # (B, H, D, S_cap, T_cap): the probe's batch at its cap, tiny, wide heads
    (32, 4, 64, 17408, 147456),
    (128, 4, 64, 17408, 720896),
    (3, 1, 8, 1024, 16),
    (2, 2, 256, 2048, 4096),
]


# ---- 1. the op --------------------------------------------------------------------------
def op_part(iters: int, warmup: int) -> dict[str, Any]:
    import torch
    from gpu_attention_probe import HEAD_DIM, HEADS, attention_flops, compare, median_ms
    from gpu_attention_probe import sample_lengths as probe_lengths

    from freescale.kernels.attention import cudnn_sdpa as ca
    from freescale.models import attention as att

    torch.manual_seed(0)
    lengths = probe_lengths(0, 32, 0)
    rows, hd = sum(lengths), HEADS * HEAD_DIM
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    fwd_flop, both_flop = attention_flops(lengths)
    do = torch.randn(rows, HEADS, HEAD_DIM, device="cuda").bfloat16()
    leaves = {
        "contiguous": torch.randn(3, rows, HEADS, HEAD_DIM, device="cuda").bfloat16(),
        "qkv views": torch.randn(rows, 3 * hd, device="cuda").bfloat16(),
    }
    out: dict[str, Any] = {"lengths": lengths, "rows": rows, "max_len": max(lengths), "rows_ms": []}
    print(
        f"op: {len(lengths)} samples, {rows} rows, longest {max(lengths)}, H={HEADS} D={HEAD_DIM}"
    )
    for layout, data in leaves.items():
        leaf = data.clone().requires_grad_()
        if layout == "contiguous":
            q, k, v = leaf.unbind(0)
        else:
            q, k, v = (x.view(rows, HEADS, HEAD_DIM) for x in leaf.chunk(3, dim=-1))
        base = None
        for path in ("varlen", "cudnn", "cudnn-copies"):
            if path == "cudnn-copies" and layout == "contiguous":
                continue
            ca.PACKED_QKV = path != "cudnn-copies"
            seg = att.segments(offsets, "cudnn" if path.startswith("cudnn") else "varlen",
                               max(lengths))  # fmt: skip
            layout_ = att.attention_layout(seg, seg, True, rows)

            def fwd(layout_=layout_, q=q, k=k, v=v):
                return att.attend(q, k, v, layout_)

            def both(fwd=fwd, q=q, k=k, v=v):
                return torch.autograd.grad(fwd(), (q, k, v), do)

            builds = ca.CACHE.builds
            row: dict[str, Any] = {"layout": layout, "path": path}
            try:
                got = [fwd().detach(), *both()]
            except Exception as e:  # one path failing must not lose the others
                row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
                out["rows_ms"].append(row)
                print(f"  {layout:10s} {path:12s} {row['error']}", flush=True)
                continue
            if path.startswith("cudnn"):
                row["graphs_built"] = ca.CACHE.builds - builds
            if base is None:
                base = got
            else:
                row["vs_varlen"] = {
                    name: compare(x, y)
                    for name, x, y in zip(("O", "dQ", "dK", "dV"), got, base, strict=True)
                }
            ms_f = median_ms(fwd, iters, warmup)
            ms_b = median_ms(both, iters, warmup)
            row.update(fwd_ms=ms_f, fwd_bwd_ms=ms_b, fwd_tflops=fwd_flop / ms_f / 1e9,
                       fwd_bwd_tflops=both_flop / ms_b / 1e9)  # fmt: skip
            out["rows_ms"].append(row)
            worst = (
                max(c["max_rel"] for c in row["vs_varlen"].values()) if "vs_varlen" in row else 0
            )
            print(
                f"  {layout:10s} {path:12s} fwd {ms_f:7.3f} ms ({row['fwd_tflops']:5.0f} TF/s)  "
                f"f+b {ms_b:7.3f} ms ({row['fwd_bwd_tflops']:5.0f} TF/s)  "
                f"max rel vs varlen {worst:.2e}",
                flush=True,
            )
    ca.PACKED_QKV = True
    out["graphs"] = {
        "builds": ca.CACHE.builds,
        "build_s": ca.CACHE.build_s,
        "engines": ca.CACHE.engines(),
        "refused": list(ca.CACHE.refused.values()),
    }
    print(f"  graphs: {json.dumps(out['graphs'])}")
    return out


# ---- 2 and 3: training runs -------------------------------------------------------------
def train(preset: str, sets: list[str], metrics: Path | None, timeout: float) -> dict[str, Any]:
    """One ``freescale train`` in a subprocess: its summary (and per-step losses)."""
    args = [sys.executable, "-m", "freescale.cli.main", "train", "--preset", preset]
    sets = [*sets, "output.progress=false"]
    if metrics is not None:
        sets.append(f"output.metrics_path={metrics}")
    for s in sets:
        args += ["--set", s]
    t0 = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    wall = time.perf_counter() - t0
    summary = None
    for line in proc.stdout.splitlines():
        if line.startswith("{") and '"command": "train"' in line:
            summary = json.loads(line)
    if proc.returncode or summary is None:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
        raise RuntimeError(f"rc {proc.returncode}: {' '.join(args)}\n" + "\n".join(tail))
    out = {"summary": summary, "wall_s": wall, "sets": sets}
    if metrics is not None:
        steps = [json.loads(x) for x in metrics.read_text().splitlines() if x.startswith("{")]
        out["losses"] = [s["loss"] for s in steps if "loss" in s and "step" in s]
    return out


def train_part(legs: dict[str, list[str]], preset: str, timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, sets in legs.items():
        got = train(preset, sets, None, timeout)
        s = got["summary"]
        out[name] = {k: s.get(k) for k in ("step_ms", "tflops", "mfu_pct", "measured_steps")}
        out[name]["wall_s"] = got["wall_s"]
        print(f"  train {name}: {json.dumps(out[name])}", flush=True)
    names = list(out)
    print(f"{'attention':12s} {'step_ms':>9s} {'TFLOP/s':>9s} {'MFU %':>7s}")
    for name in names:
        r = out[name]
        print(f"{name:12s} {r['step_ms']:9.1f} {_num(r['tflops'], 9.1)} {_num(r['mfu_pct'], 7.1)}")
    if len(names) == 2 and out[names[0]]["step_ms"]:
        ratio = out[names[1]]["step_ms"] / out[names[0]]["step_ms"]
        out["step_ms_ratio"] = ratio
        print(f"  {names[1]} / {names[0]} step_ms: {ratio:.3f}")
    return out


def losses_part(legs: dict[str, list[str]], preset: str, timeout: float) -> dict[str, Any]:
    out: dict[str, Any] = {"runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, sets in legs.items():
            got = train(preset, sets, Path(tmp) / f"{name}.jsonl", timeout)
            out["runs"][name] = {"losses": got["losses"], "wall_s": got["wall_s"]}
            print(f"  losses {name}: {len(got['losses'])} steps, last {got['losses'][-1]:.5f}, "
                  f"{got['wall_s']:.0f}s", flush=True)  # fmt: skip
    runs = {k: v["losses"] for k, v in out["runs"].items()}
    base = runs["varlen-s0"]

    def gaps(other: str) -> list[float]:
        return [abs(a - b) for a, b in zip(runs[other], base, strict=True)]

    for other in [k for k in runs if k != "varlen-s0"]:
        g = gaps(other)
        out[f"|{other} - varlen-s0|"] = {"max": max(g), "mean": sum(g) / len(g)}
    cud, seed = gaps("cudnn-s0"), gaps("varlen-s1")
    out["steps_cudnn_within_seed_gap"] = sum(a <= b for a, b in zip(cud, seed, strict=True))
    out["accept"] = max(cud) <= max(seed)
    print(f"per step |loss - loss(varlen seed 0)| over {len(cud)} steps:")
    for key, v in out.items():
        if key.startswith("|"):
            print(f"  {key:28s} max {v['max']:.5f} mean {v['mean']:.5f}")
    print(f"  steps where cudnn's gap <= the seed gap: {out['steps_cudnn_within_seed_gap']}"
          f"/{len(cud)}; accept (max cudnn gap <= max seed gap): {out['accept']}")  # fmt: skip
    return out


def _num(x: float | None, spec: float) -> str:
    width, prec = str(spec).split(".")
    return "-".rjust(int(width)) if x is None else f"{x:{width}.{prec}f}"


# ---- CPU ----------------------------------------------------------------------------------
def cpu_check() -> dict[str, str]:
    """Validate and lower every graph for sm90 without a device (no torch)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "cudnn_graphs", ROOT / "freescale" / "kernels" / "attention" / "cudnn_graphs.py"
    )
    cg = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules["cudnn_graphs"] = cg
    spec.loader.exec_module(cg)  # type: ignore[union-attr]
    import cudnn
    import cudnn._pygraph as pygraph_module

    pygraph_module._default_backend_handle = lambda: None  # CPU: no handle (the probe's trick)
    print(f"cudnn frontend {cudnn.__version__}, backend {cudnn.backend_version_string()} (CPU)")
    results = {}
    for b, h, d, s, t in CHECK_SPECS:
        for tok in (h * d, 3 * h * d):
            for dtype in ("bf16", "fp16"):
                for backward in (False, True):
                    gs = cg.GraphSpec(b, h, d, s, tok, dtype, t if backward else 0)
                    key = f"{'bwd' if backward else 'fwd'} {gs}"
                    try:
                        g = cudnn.pygraph(
                            io_data_type=getattr(cudnn.data_type,
                                                 "BFLOAT16" if dtype == "bf16" else "HALF"),
                            intermediate_data_type=cudnn.data_type.FLOAT,
                            compute_data_type=cudnn.data_type.FLOAT,
                            sm_version=90,
                            sm_count=132,
                        )  # fmt: skip
                        declare = cg.declare_backward if backward else cg.declare_forward
                        tensors = declare(cudnn, g, gs)
                        cg.check_roles(tensors, cg.BWD_DATA if backward else cg.FWD_DATA)
                        g.validate()
                        g.build_operation_graph()
                        g._lower_backend_graph()
                        results[key] = "ok"
                    except Exception as e:
                        results[key] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
                    print(f"  {results[key]:4s} {key}")
    bad = [k for k, v in results.items() if v != "ok"]
    if bad:
        raise SystemExit(f"{len(bad)} graph(s) failed the CPU check")
    return results


# ---- main -----------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    import torch

    from freescale.kernels.attention import cudnn_sdpa as ca

    meta: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        meta.update(device=torch.cuda.get_device_name(),
                    capability=list(torch.cuda.get_device_capability()),
                    torch_cudnn=torch.backends.cudnn.version())  # fmt: skip
    cudnn = ca.import_cudnn()
    if cudnn is None:
        meta["cudnn_frontend"] = f"unavailable: {ca.import_error()}"
    else:
        meta.update(cudnn_frontend=cudnn.__version__, cudnn_backend=cudnn.backend_version_string())
    return meta


def write(report: dict[str, Any]) -> None:
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "cudnn_attention.json"), "w") as f:
            json.dump(report, f, indent=1, default=str)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip", default="", help="comma-separated parts to skip: op,train,losses")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--train-steps", type=int, default=40)
    p.add_argument("--train-warmup", type=int, default=20)
    p.add_argument("--loss-steps", type=int, default=200)
    p.add_argument("--no-rerun", action="store_true", help="skip the second varlen seed-0 run")
    p.add_argument("--timeout", type=float, default=240, help="seconds per training run")
    p.add_argument("--cpu-check", action="store_true", help=cpu_check.__doc__)
    p.add_argument("--cpu-smoke", action="store_true", help="parts 2 and 3 as tiny CPU runs")
    args = p.parse_args(argv)
    if args.cpu_check:
        cpu_check()
        return
    skip = set(filter(None, args.skip.split(",")))
    sys.path.insert(0, str(ROOT))
    report: dict[str, Any] = {"meta": environment()}
    print(" ".join(f"{k}={v}" for k, v in report["meta"].items()), flush=True)
    t0 = time.perf_counter()
    if args.cpu_smoke:  # the script's own plumbing: demo preset, CPU attention choices
        new, old, common = "auto", "reference", ["run.nproc=1", "run.device=cpu"]
        train_preset, train_sets = "demo", [*common, "run.batch_size=8", "data.max_uih=32"]
        loss_preset, loss_sets = "demo", [*common, "run.batch_size=8", "data.max_uih=32"]
        skip.add("op")
        args.train_steps, args.train_warmup, args.loss_steps = 6, 2, 8
    else:
        new, old = "cudnn", "varlen"
        train_preset, train_sets = "h200-21k", ["run.nproc=1", "run.batch_size=128"]
        loss_preset = "h200-8k"
        loss_sets = ["run.nproc=1", "run.batch_size=32", "data.max_uih=2000"]
    try:
        if "op" not in skip:
            report["op"] = op_part(args.iters, args.warmup)
            write(report)
        if "train" not in skip:
            steps = [f"run.steps={args.train_steps}", f"run.warmup={args.train_warmup}"]
            legs = {a: [*train_sets, *steps, f"model.attention={a}"] for a in (old, new)}
            print(f"train: {train_preset} {' '.join(train_sets + steps)}", flush=True)
            report["train"] = train_part(legs, train_preset, args.timeout)
            write(report)
        if "losses" not in skip:
            steps = [f"run.steps={args.loss_steps}", "run.warmup=10"]
            if args.cpu_smoke:
                steps = [f"run.steps={args.loss_steps}", "run.warmup=2"]
            legs = {
                f"{old}-s0": [*loss_sets, *steps, f"model.attention={old}", "run.seed=0"],
                f"{old}-s1": [*loss_sets, *steps, f"model.attention={old}", "run.seed=1"],
                f"{new}-s0": [*loss_sets, *steps, f"model.attention={new}", "run.seed=0"],
            }
            if not args.no_rerun:
                legs[f"{old}-s0-again"] = legs[f"{old}-s0"]
            print(f"losses: {loss_preset} {' '.join(loss_sets + steps)}", flush=True)
            renamed = {k.replace(old, "varlen").replace(new, "cudnn"): v for k, v in legs.items()}
            report["losses"] = losses_part(renamed, loss_preset, args.timeout)
    finally:
        report["wall_s"] = time.perf_counter() - t0
        write(report)
    print(f"done in {report['wall_s']:.0f}s")


if __name__ == "__main__":
    main()
