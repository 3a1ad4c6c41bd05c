"""Run freescale's Triton kernels compiled on CUDA, or in Triton's CPU interpreter.

Triton picks the interpreter when it *decorates* a kernel (when a module of
`freescale.kernels.triton_*` is first imported) and reads TRITON_INTERPRET again
while launching. So, on a machine without CUDA, a package-scoped fixture sets
TRITON_INTERPRET=1 for the tests of this folder only, imports the kernels under
it, and restores the environment when the folder is done: tests elsewhere see
it unchanged. Tests that start subprocesses pass an explicit environment.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from freescale.kernels.backend import triton_available, triton_module

TRITON_MODULES = (
    "common", "bucketize", "rows", "host_rows", "permute", "dispatch", "collision", "small_table",
    "attention.hstu_fwd", "attention.hstu_bwd", "attention.cross",
)  # fmt: skip


def _fix_interpreter_loop_bounds() -> None:
    """Triton 3.6's interpreter converts a runtime loop bound (a 1-element array)
    with ``int(array)``, which NumPy >= 2.4 rejects; read the element instead.
    Only the interpreter's per-launch patch of ``tl.tensor.__index__`` changes."""
    try:
        int(np.ones(1))
        return
    except TypeError:
        pass
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "freescale_fixed", False):
        return

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched.freescale_fixed = True  # type: ignore[attr-defined]
    interpreter._patch_lang_tensor = patched


def _interpreting() -> bool:
    return triton_available() and not torch.cuda.is_available()


@pytest.fixture(scope="package", autouse=True)
def _triton_interpreter() -> Iterator[None]:
    """TRITON_INTERPRET=1 while this folder's tests run (CPU machines with Triton)."""
    if not _interpreting():
        yield
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        for name in TRITON_MODULES:
            triton_module(name)
        _fix_interpreter_loop_bounds()
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


@pytest.fixture(scope="package")
def triton_device(_triton_interpreter: None) -> str:
    """ "cuda" (compiled kernels) or "cpu" (interpreted); skips without Triton."""
    if not triton_available():
        pytest.skip("Triton is not installed")
    if torch.cuda.is_available():
        return "cuda"
    from triton.runtime.interpreter import InterpretedFunction

    from freescale.kernels import triton_permute as permute

    if not isinstance(permute._permute_rows_kernel, InterpretedFunction):
        pytest.fail("freescale's Triton kernels were imported before the interpreter was set")
    return "cpu"


def clean_env() -> dict[str, str]:
    """The environment for subprocesses: without this folder's TRITON_INTERPRET."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return env
