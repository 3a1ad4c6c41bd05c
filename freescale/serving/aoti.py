"""AOTInductor compile of a saved program, in a child process of its own.

Inductor runs the kernels it tunes while it compiles, on buffers it fills
itself; on CUDA an index tensor among them can trip a bounds assert in a
generated kernel (torch 2.11 on an H200, the padded attention: pytorch#194018),
and a device-side assert ends the process with thousands of lines. Compiled
here, in a child (``python -m freescale.serving.aoti PROGRAM PACKAGE``), such
a failure is one paragraph for the caller (`compile_package`) and the parent's
CUDA context, and its exported program, stay intact.

Inductor's vectorized C++ does not compile for every op (torch 2.13: an int32
-> int64 convert of HSTU's buckets): such a program is compiled again without
vectorization, scalar but correct. The package holds code only: its weights
are the program's (`WEIGHTS`; `freescale.serving.load` gives them to it).

The child then loads the package it wrote, with those weights: on an H200
(torch 2.11) even a two-layer linear's CUDA package crashed its loader with a
segmentation fault. A package that does not load here is removed and the
caller gets one paragraph, not a server that dies on its first `load`. The
child prints the JSON of the Inductor configs it used after `MARK`, once
compiled, and `LOADS` once loaded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import freescale

ERROR_LINES = 2  # the child's last error lines kept in the paragraph
TIMEOUT_S = 3 * 3600  # a compile takes minutes; one that takes hours is stuck
MARK = "freescale-aoti-configs "  # the child's result line
LOADS = "freescale-aoti-loads"  # the child's last line: the package loaded
SERVES = "The torch.export program was written and serves (freescale.serving.load(OUT, aoti=False))"
# The weights stay out of the package's shared library: `load` gives it the
# program's (no second copy of the tables; packages with ~10 GB of embedded
# weights did not load on an H200, torch 2.11).
WEIGHTS = {"aot_inductor.package_constants_in_so": False}
_RAISED = re.compile(r"[\w.]*(Error|Exception)\w*: ")  # "torch._inductor.exc.InductorError: ..."


class CompileError(RuntimeError):
    """The AOTInductor compile failed (one paragraph)."""


def compile_package(program: Path, package: Path) -> dict[str, Any]:
    """Compile the saved program ``program`` into the package ``package`` in a
    child process; the Inductor configs it used. `CompileError` on failure."""
    # This process's freescale, whatever the working directory holds (-P: no
    # cwd on sys.path; no empty PYTHONPATH entry, which would mean cwd too).
    root = str(Path(freescale.__file__).resolve().parents[1])
    paths = [root, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    cmd = [sys.executable, "-P", "-m", "freescale.serving.aoti",
           str(Path(program).resolve()), str(Path(package).resolve())]  # fmt: skip
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise CompileError(
            f"AOTInductor did not compile {program} in {TIMEOUT_S} s (child stopped). {SERVES}"
        ) from None
    lines = done.stdout.splitlines()
    marked = [ln for ln in lines if ln.startswith(MARK)]
    if done.returncode == 0 and LOADS in lines:
        return json.loads(marked[-1][len(MARK) :])
    if marked:  # compiled, then failed to load: never leave a package that kills its loader
        Path(package).unlink(missing_ok=True)
        why = f": {_reason(done.stderr)}" if done.returncode > 0 else ""  # a signal leaves no error
        raise CompileError(
            f"AOTInductor compiled {program}, but the package failed to load in a fresh process "
            f"({_ended(done.returncode)}, torch {_torch_version()}){why}; it was removed. {SERVES}"
        )
    raise CompileError(
        f"AOTInductor could not compile {program} (child process rc {done.returncode}): "
        f"{_reason(done.stderr)}. {SERVES}"
    )


def _ended(returncode: int) -> str:
    """How the child ended: ``signal SIGSEGV`` or ``rc 1``."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"rc {returncode}"


def _torch_version() -> str:
    import torch

    return torch.__version__


def _reason(stderr: str) -> str:
    """The first failed assertion, if any, and the last error lines."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    asserts = [ln for ln in lines if "Assertion" in ln][:1]
    errors = [ln for ln in lines if _RAISED.match(ln)]
    text = " ".join([*asserts, *errors[-ERROR_LINES:]]) or (lines[-1] if lines else "no output")
    return text[:600].rstrip(". ")


def _compile(program: Path, package: Path) -> dict[str, Any]:
    import torch
    from torch._inductor import aoti_compile_and_package

    from freescale.models import attention_op  # noqa: F401  (the op programs call)

    loaded = torch.export.load(str(program))
    try:
        aoti_compile_and_package(loaded, package_path=str(package), inductor_configs=WEIGHTS)
        return dict(WEIGHTS)
    except Exception as e:
        if "CppCompileError" not in f"{type(e).__name__} {e}"[:300]:
            raise
    scalar = {**WEIGHTS, "cpp.simdlen": 1}
    aoti_compile_and_package(loaded, package_path=str(package), inductor_configs=scalar)
    return scalar


def _check_loads(package: Path, program: Path) -> None:
    """Load ``package`` as `freescale.serving.load` does (its weights given
    from ``program``); a crash here ends this child, not the caller."""
    import torch
    from torch._inductor import aoti_load_package

    give_weights(aoti_load_package(str(package)), torch.export.load(str(program)), package)


def give_weights(compiled: Any, program: Any, path: Path) -> dict[str, Any]:
    """Hand ``program``'s weights to the loaded package ``compiled`` (read
    from ``path``); the tensors it now reads, which must outlive it."""
    needed = compiled.get_constant_fqns()
    weights = {**program.state_dict, **program.constants}
    missing = [name for name in needed if name not in weights]
    if missing:
        raise ValueError(f"{path}: the program has no weights {missing[:3]} that the package needs")
    held = {name: weights[name] for name in needed}
    # user_managed: the package reads these tensors in place (no second copy).
    compiled.load_constants(held, check_full_update=True, user_managed=True)
    return held


if __name__ == "__main__":
    used = _compile(Path(sys.argv[1]), Path(sys.argv[2]))
    print(MARK + json.dumps(used), flush=True)
    _check_loads(Path(sys.argv[2]), Path(sys.argv[1]))
    print(LOADS, flush=True)
