"""Partitioner names: ``"none" | "fbs" | "vbs" | "cost"`` or a user callable.

`resolve_partitioner` is what configs go through (``balance = fbs`` etc.).
Users may also `register_partitioner` a function under a name of their own.
Built-in names resolve to their default configuration; pass an instance
(``VBS(alpha=2.0)``, ``FBS(key="tokens")``) for another one.
"""

from __future__ import annotations

from collections.abc import Callable

from freescale.balance.costpart import CostPartitioner
from freescale.balance.fbs import FBS, identity
from freescale.balance.runtime import Partitioner
from freescale.balance.vbs import VBS

_BUILTIN: dict[str, Callable[[], Partitioner]] = {
    "none": lambda: identity,
    "fbs": FBS,
    "vbs": VBS,
    "cost": CostPartitioner,
}
_USER: dict[str, Partitioner] = {}


def partitioner_names() -> tuple[str, ...]:
    return (*_BUILTIN, *sorted(_USER))


def register_partitioner(name: str, fn: Partitioner) -> None:
    """Make ``fn`` (same signature as the built-ins) resolvable by ``name``."""
    if not isinstance(name, str) or not name or name in _BUILTIN:
        raise ValueError(f"cannot register a partitioner as {name!r}")
    if not callable(fn):
        raise ValueError(f"partitioner {name!r} must be callable")
    _USER[name] = fn


def resolve_partitioner(spec: str | Partitioner) -> Partitioner:
    """A partitioner from a name (built in or registered) or a callable (as is)."""
    if isinstance(spec, str):
        if spec in _BUILTIN:
            return _BUILTIN[spec]()
        if spec in _USER:
            return _USER[spec]
        raise ValueError(f"unknown partitioner {spec!r}; expected one of {partitioner_names()}")
    if callable(spec):
        return spec
    raise ValueError(f"a partitioner is a name or a callable, got {type(spec).__name__}")
