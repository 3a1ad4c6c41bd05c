"""The global random number generators' states, as tensors and plain numbers.

A checkpoint restores python's `random`, numpy's global generator, torch's CPU
generator and (when CUDA is in use) every CUDA generator, so that anything a
resumed run draws is what the uninterrupted run would have drawn. Their
native states are a tuple of ints (python) and a tuple holding an ndarray
(numpy); unpickling an ndarray needs numpy's reconstructor, which
``torch.load(weights_only=True)`` refuses. So the states are stored as int64
tensors plus ints, floats and strings: a file of them loads with
``weights_only=True`` (`freescale.state.checkpoint_files`).

`check_rng_state` applies a state to throw-away generators: a malformed one
(a damaged or hand-made file) fails there, before any global state changes.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """This process's generator states (plain types: tensors, ints, floats, str)."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": str(name),
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _python(state: dict[str, Any]) -> tuple:
    py = state["python"]
    return (int(py["version"]), tuple(int(x) for x in py["mt"].tolist()), py["gauss"])


def _numpy(state: dict[str, Any]) -> tuple:
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    return (n["name"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"]))


def check_rng_state(state: Any, where: str) -> None:
    """ValueError (one line naming ``where``) unless ``state`` restores cleanly."""
    try:
        random.Random().setstate(_python(state))
        np.random.RandomState().set_state(_numpy(state))
        torch.Generator().set_state(state["torch"])
        if "cuda" in state and not all(isinstance(t, torch.Tensor) for t in state["cuda"]):
            raise TypeError("cuda states must be tensors")
    except Exception as e:  # any failure: the state is not one we wrote
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(
            f"checkpoint file {where} holds a malformed RNG state ({detail})"
        ) from None


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned (CUDA only where CUDA is available)."""
    random.setstate(_python(state))
    np.random.set_state(_numpy(state))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
