"""Partitioner names: the built-ins, registered names and user code.

`resolve_partitioner` is what configs go through (``balance = fbs``,
``balance = mymodule:plan``). A name is a built-in (``none``, ``fbs``,
``vbs``, ``cost``: their default configuration), one given to
`register_partitioner`, or user code named ``module:qualname``
(`freescale.naming`), imported where the plan is made: a rank, or its
planning process. Pass an instance (``VBS(alpha=2.0)``) or any callable with
the signature for another configuration.
"""

from __future__ import annotations

from collections.abc import Callable

from freescale.balance.costpart import CostPartitioner
from freescale.balance.fbs import FBS, identity
from freescale.balance.runtime import Partitioner
from freescale.balance.vbs import VBS
from freescale.naming import FORM, is_named, load_named

_BUILTIN: dict[str, Callable[[], Partitioner]] = {
    "none": lambda: identity,
    "fbs": FBS,
    "vbs": VBS,
    "cost": CostPartitioner,
}
_USER: dict[str, Partitioner] = {}
BUILTIN_PARTITIONERS = tuple(_BUILTIN)


def partitioner_names() -> tuple[str, ...]:
    return (*_BUILTIN, *sorted(_USER))


def register_partitioner(name: str, fn: Partitioner) -> None:
    """Make ``fn`` (same signature as the built-ins) resolvable by ``name``."""
    if not isinstance(name, str) or not name or name in _BUILTIN or ":" in name:
        raise ValueError(f"cannot register a partitioner as {name!r}")
    if not callable(fn):
        raise ValueError(f"partitioner {name!r} must be callable")
    _USER[name] = fn


def check_partitioner_name(name: str, key: str = "partitioner") -> None:
    """One-line ValueError unless ``name`` is a partitioner's name (user code
    is only checked for its form here: `resolve_partitioner` imports it)."""
    if isinstance(name, str) and (name in _BUILTIN or name in _USER or is_named(name)):
        return
    raise ValueError(
        f"{key} must be one of {', '.join(partitioner_names())}, or your own partitioner"
        f" as {FORM} (e.g. mymodule:plan, a function partition(world, runtime) -> Plan);"
        f" got {name!r}"
    )


def resolve_partitioner(spec: str | Partitioner, key: str = "partitioner") -> Partitioner:
    """A partitioner from a name (built in, registered or ``module:qualname``)
    or a callable (as is); ``key``: the config key, for the messages."""
    if isinstance(spec, str):
        check_partitioner_name(spec, key)
        if spec in _BUILTIN:
            return _BUILTIN[spec]()
        if spec in _USER:
            return _USER[spec]
        return load_named(spec, key)
    if callable(spec):
        return spec
    raise ValueError(f"a partitioner is a name or a callable, got {type(spec).__name__}")
