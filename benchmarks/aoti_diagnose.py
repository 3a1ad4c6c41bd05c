"""Why a CUDA AOTInductor package does not load (GPU machine diagnostic).

Compiles a two-layer linear once for the GPU and once for the CPU, then loads
each package in child processes in several ways, and prints one line each
(rc or signal, the last error line). With ``--gdb`` the plain CUDA load runs
again under ``cuda-gdb -batch`` for a native backtrace. Also prints the
shared library's unresolved libraries (``ldd``) and the toolchain.

    python -m benchmarks.aoti_diagnose --out DIR [--gdb]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import torch

MODES = ("plain", "cuda_first", "single_thread", "raw_loader", "runner")


def compile_packages(out: Path, devices: list[str]) -> dict[str, str]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    paths = {}
    for dev in devices:
        m = model.to(dev).eval()
        x = torch.randn(4, 64, device=dev)
        t0 = time.perf_counter()
        ep = torch.export.export(m, (x,))
        path = out / f"linear_{dev}.pt2"
        torch._inductor.aoti_compile_and_package(ep, package_path=str(path))
        print(f"compiled {dev} in {time.perf_counter() - t0:.1f}s -> {path}", flush=True)
        torch.save({"x": x.cpu(), "y": m(x).detach().cpu()}, out / f"linear_{dev}.io")
        paths[dev] = str(path)
    return paths


def load(mode: str, path: str) -> None:
    """One way of loading ``path`` and scoring its saved input (runs in a child)."""
    io = torch.load(path.replace(".pt2", ".io"))
    dev = "cuda" if path.endswith("_cuda.pt2") else "cpu"
    if mode == "cuda_first":
        torch.zeros(1, device="cuda").add_(1)
        torch.cuda.synchronize()
    if mode in ("plain", "cuda_first"):
        run = torch._inductor.aoti_load_package(path)
    elif mode == "single_thread":
        run = torch._inductor.aoti_load_package(path, run_single_threaded=True)
    elif mode == "raw_loader":
        loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
        run = lambda x: loader.run([x])[0]  # noqa: E731
    else:  # the library out of the zip, run by the container runner
        tmp = Path(path).with_suffix(".unzipped")
        with zipfile.ZipFile(path) as z:
            z.extractall(tmp)
        so = next(tmp.rglob("*.so"))
        cls = torch._C._aoti.AOTIModelContainerRunnerCuda if dev == "cuda" else \
            torch._C._aoti.AOTIModelContainerRunnerCpu  # fmt: skip
        runner = cls(str(so), 1) if dev == "cpu" else cls(str(so), 1, "cuda", str(so.parent))
        run = lambda x: runner.run([x])[0]  # noqa: E731
    print("loaded", flush=True)
    got = run(io["x"].to(dev))
    got = got[0] if isinstance(got, (list, tuple)) else got
    print(f"max diff {(got.cpu() - io['y']).abs().max().item():.3g}", flush=True)


def child(mode: str, path: str, gdb: bool = False) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.aoti_diagnose", "--load", mode, path]
    if gdb:
        cmd = ["cuda-gdb", "-batch", "-ex", "run", "-ex", "bt 40", "-ex", "info sharedlibrary",
               "--args", *cmd]  # fmt: skip
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    rc = r.returncode
    how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"rc {rc}"
    lines = (r.stdout + r.stderr).strip().splitlines()
    return {"mode": mode + (" (cuda-gdb)" if gdb else ""), "package": Path(path).name, "exit": how,
            "s": round(time.perf_counter() - t0, 1), "tail": lines[-3:], "all": lines}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--gdb", action="store_true")
    ap.add_argument("--devices", default="cuda,cpu")
    ap.add_argument("--load", nargs=2)
    args = ap.parse_args()
    if args.load:
        return load(*args.load)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"torch {torch.__version__} cuda {torch.version.cuda} cxx "
          f"{torch._inductor.config.cpp.cxx}", flush=True)  # fmt: skip
    for tool in ("gcc", "g++", "nvcc", "cuda-gdb"):
        print(f"{tool}: {shutil.which(tool)}", flush=True)
    paths = compile_packages(args.out, args.devices.split(","))
    for dev, path in paths.items():
        tmp = Path(path).with_suffix(".ldd")
        with zipfile.ZipFile(path) as z:
            z.extractall(tmp)
            print(dev, "package files:", z.namelist(), flush=True)
        for so in tmp.rglob("*.so"):
            r = subprocess.run(["ldd", str(so)], capture_output=True, text=True)
            print(f"ldd {so.name}:\n{r.stdout}{r.stderr}", flush=True)
    results = []
    for path in paths.values():
        for mode in MODES:
            results.append(child(mode, path))
            print(json.dumps({k: v for k, v in results[-1].items() if k != "all"}), flush=True)
    if args.gdb and "cuda" in paths:
        results.append(child("plain", paths["cuda"], gdb=True))
        print("\n".join(results[-1]["all"][-80:]), flush=True)
    (args.out / "aoti-diagnose.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
