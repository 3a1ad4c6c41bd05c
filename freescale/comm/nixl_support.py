"""NIXL for the SM-free backend: whether it is installed, its API, where buffers live.

Importing this module never imports NIXL: configs are validated with
`nixl_installed`, which only looks the package up. `nixl_api` imports it.

Staging (``pipeline.comm_staging``): ``host`` keeps the chunks in registered
host memory (D2H, transfer, H2D: the copy engines and the NIC/CPU move the
bytes); ``device`` registers GPU buffers with NIXL, so UCX moves GPU memory
itself (GPUDirect RDMA between hosts, CUDA IPC inside one) and the
D2H/H2D hops become device-to-device copies into those buffers; ``auto``
takes ``device`` where it is available, else ``host``.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from types import ModuleType

import torch

INSTALL_HINT = "pip install 'freescale[rdma]'"
STAGINGS = ("host", "device", "auto")
# The `nixl` meta package picks its CUDA variant at run time; the variants also
# install alone.
_PACKAGES = ("nixl", "nixl_cu13", "nixl_cu12")


def nixl_installed() -> bool:
    """True if a NIXL package is installed (looked up, not imported)."""
    return any(importlib.util.find_spec(name) is not None for name in _PACKAGES)


def missing_message(what: str) -> str:
    return f"{what} needs NIXL, which is not installed: {INSTALL_HINT}"


def nixl_api() -> ModuleType:
    """NIXL's Python API module (``nixl_agent`` and friends); ImportError in one line."""
    problems = []
    quiet = not os.environ.get("NIXL_LOG_LEVEL")
    if quiet:
        # Its own log lines (Python INFO on stdout, where the trainer prints its
        # summary; C++ errors that repeat ours) stay out; NIXL_LOG_LEVEL=WARN shows them.
        os.environ["NIXL_LOG_LEVEL"] = "FATAL"
    for name in _PACKAGES:
        try:
            api = importlib.import_module(f"{name}._api")
        except ImportError as exc:
            problems.append(f"{name}: {exc}")
            continue
        if quiet:
            logging.getLogger("nixl").setLevel(logging.ERROR)
        return api
    raise ImportError(f"NIXL does not import ({'; '.join(problems)}); {INSTALL_HINT}")


def pick_staging(
    requested: str, device: torch.device, probe: Callable[[], tuple[bool, str]]
) -> tuple[str, str]:
    """``("host" | "device", why)`` for ``pipeline.comm_staging=requested``.

    ``probe()`` says whether GPU memory can be registered with the transfer
    engine (and why not); it is called only where the answer matters.
    """
    if requested not in STAGINGS:
        raise ValueError(f"comm staging must be one of {', '.join(STAGINGS)}, got {requested!r}")
    if device.type != "cuda":
        if requested == "device":
            raise ValueError(
                f"pipeline.comm_staging=device needs a CUDA device, the run is on {device.type}"
            )
        return "host", f"tensors on {device.type}"
    if requested == "host":
        return "host", "pipeline.comm_staging=host"
    ok, why = probe()
    if ok:
        return "device", why
    if requested == "device":
        raise ValueError(f"pipeline.comm_staging=device is not available here: {why}")
    return "host", f"no device path: {why}"


def ucx_excludes_cuda(env: dict[str, str] | os._Environ[str]) -> bool:
    """True if ``UCX_TLS`` names transports and none of them is a CUDA one."""
    tls = env.get("UCX_TLS", "").strip()
    if not tls or tls.startswith("^") or tls == "all":
        return False
    return not any(t.strip().startswith(("cuda", "gdr")) for t in tls.split(","))
