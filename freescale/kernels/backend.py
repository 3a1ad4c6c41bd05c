"""Which implementation of a kernel op runs: ``torch``, ``eager`` or ``triton``.

Every public op in `freescale.kernels` takes ``impl=None``; the choice is, in
order: the ``impl`` argument, the ``FREESCALE_KERNELS`` environment variable,
then ``auto`` = Triton for CUDA tensors (when Triton is installed), the
vectorized torch reference otherwise. ``eager`` is the per-sample/per-rank loop
the paper measures against; it exists for benchmarks and tests.

Triton is imported only here, only when the Triton path is taken, so
``import freescale.kernels`` stays cheap and works without Triton.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from functools import cache
from types import ModuleType
from typing import Literal

import torch

Impl = Literal["torch", "eager", "triton"]
IMPL_ENV = "FREESCALE_KERNELS"
CHOICES = ("auto", "torch", "eager", "triton")


@cache
def triton_available() -> bool:
    """Whether Triton can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def choose_impl(impl: str | None, device: torch.device) -> Impl:
    """Resolve ``impl`` (or the environment override) for tensors on ``device``."""
    choice = impl if impl is not None else os.environ.get(IMPL_ENV, "auto") or "auto"
    if choice not in CHOICES:
        source = "impl" if impl is not None else IMPL_ENV
        raise ValueError(f"{source}={choice!r}: expected one of {CHOICES}")
    if choice == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if choice == "triton" and not triton_available():
        raise RuntimeError("impl='triton' was requested but Triton is not installed")
    return choice  # type: ignore[return-value]


def triton_module(name: str) -> ModuleType:
    """Import ``freescale.kernels.triton_<name>``, or for ``<package>.<name>``
    ``freescale.kernels.<package>.triton_<name>`` (this is what imports Triton)."""
    package, _, leaf = name.rpartition(".")
    where = f"freescale.kernels.{package}" if package else "freescale.kernels"
    return importlib.import_module(f"{where}.triton_{leaf}")
