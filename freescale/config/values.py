"""Parsing and checking single config values: one-line ValueErrors naming the key."""

from __future__ import annotations

import math
from typing import Any

LR_DECAYS = ("none", "linear", "cosine")


def integer(name: str, value: Any) -> int:
    """An integer key given as a number or as text (``--set``)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None


def on_off(value: Any) -> Any:
    """A switch given as a boolean (a file's ``true``, ``--set`` text) as ``on``/``off``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return "on" if value.lower() == "true" else "off"
    return value


def choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


def at_least(section: object, prefix: str, names: tuple[str, ...], low: int) -> None:
    for name in names:
        value = getattr(section, name)
        if value < low:
            raise ValueError(f"{prefix}.{name} must be >= {low}, got {value}")


def schedule_keys(prefix: str, section: Any) -> None:
    """The optimizer keys shared by ``dense`` and ``embeddings``."""
    finite(prefix, "weight_decay", section.weight_decay, 0)
    at_least(section, prefix, ("lr_warmup",), 0)
    choice(f"{prefix}.lr_decay", section.lr_decay, LR_DECAYS)


def finite(prefix: str, name: str, value: float, low: float, strict: bool = False) -> None:
    if not (math.isfinite(value) and (value > low if strict else value >= low)):
        sign = ">" if strict else ">="
        raise ValueError(f"{prefix}.{name} must be a finite number {sign} {low:g}, got {value}")


def trace_window(text: str) -> tuple[int, int]:
    """``"10-12"`` -> (10, 12): the steps a profiler trace covers (inclusive)."""
    try:
        a, b = (int(x) for x in text.split("-"))
    except ValueError:
        raise ValueError(f"output.trace_steps must look like '10-12', got {text!r}") from None
    if not 0 <= a <= b:
        raise ValueError(f"output.trace_steps must be an increasing range, got {text!r}")
    return a, b


def parse_ranks(text: str) -> set[int] | None:
    """``"1,3"`` -> {1, 3}; ``""`` -> None (every rank). ValueError on bad input."""
    if not text.strip():
        return None
    try:
        ranks = {int(part) for part in text.split(",")}
    except ValueError:
        raise ValueError(f"delay_ranks must be comma-separated ranks, got {text!r}") from None
    if min(ranks) < 0:
        raise ValueError(f"delay_ranks must be >= 0, got {text!r}")
    return ranks
