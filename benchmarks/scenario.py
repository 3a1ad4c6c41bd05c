"""Scenario files: what one benchmark runs, read from ``scenarios/NAME.toml``.

A scenario names its ``measure`` (a function in this package, ``MEASURES``),
the paper figure or regression guard it stands for, the device and world
sizes it needs, the measure's parameters, the training grid and fixed config
overrides (by the harness's key names, mapped to config keys by
``scenarios/keys.toml``), the metrics its table shows, its checks, and a
``[smoke]`` table merged over all of that for ``--smoke`` (a seconds-long CPU
run that exercises the plumbing, never a result)::

    title = "Fig. 8: straggler % vs load balancing"
    figure = "8"                  # or: guard = "overhead"
    measure = "train"
    device = "cuda"               # cuda | cpu | any
    ranks = [2]                   # world sizes; GPUs needed = max(ranks) on cuda
    metrics = ["step_ms", "straggler_pct"]
    [params]                      # the measure's own parameters
    [grid]                        # axes: harness key -> list of values
    [set]                         # fixed overrides: harness key -> value
    [[checks]]                    # see runner.check
    [smoke]                       # same tables, merged over the above
    [inputs]                      # files read from outside the repository:
                                  # ENV_VAR -> what the file is

A value in ``[set]`` or ``[grid]`` may name an input as ``${ENV_VAR}``; a run
whose inputs are not set, or not files, stops before it starts with one line
saying what to provide (and the smoke tests skip it).
"""

from __future__ import annotations

import copy
import os
import string
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
MEASURES = ("train", "ab", "kernels", "interference", "comm", "embedding", "sim_project",
            "sim_validate", "stream", "hstu", "attention", "serving", "dynamic_table",
            "quality_dynamic")  # fmt: skip
DEVICES = ("cuda", "cpu", "any")


def config_keys() -> dict[str, str]:
    """Harness key -> `freescale train --set` key (scenarios/keys.toml)."""
    return tomllib.loads((SCENARIOS / "keys.toml").read_text())["config"]


def setting(key: str, value: Any) -> str:
    """One ``--set`` override for harness key ``key``; unknown keys are errors, so
    every config key the harness writes is in keys.toml."""
    keys = config_keys()
    if key not in keys:
        raise ValueError(f"config key {key!r} is not in scenarios/keys.toml")
    if isinstance(value, bool):
        value = str(value).lower()
    if isinstance(value, str) and "${" in value:
        value = string.Template(value).substitute(os.environ)
    return f"{keys[key]}={value}"


@dataclass
class Scenario:
    name: str
    title: str
    measure: str
    device: str = "any"
    ranks: list[int] = field(default_factory=lambda: [1])
    figure: str = ""
    guard: str = ""
    launcher: str = "self"
    metrics: list[str] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    grid: dict[str, list[Any]] = field(default_factory=dict)
    set: dict[str, Any] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    smoke: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, str] = field(default_factory=dict)
    notes: str = ""

    def __post_init__(self) -> None:
        if self.measure not in MEASURES:
            raise ValueError(f"{self.name}: measure {self.measure!r} not in {MEASURES}")
        if self.device not in DEVICES:
            raise ValueError(f"{self.name}: device {self.device!r} not in {DEVICES}")
        if bool(self.figure) == bool(self.guard):
            raise ValueError(f"{self.name}: give exactly one of figure or guard")
        if self.launcher not in ("self", "torchrun"):
            raise ValueError(f"{self.name}: launcher must be self or torchrun")
        if not self.ranks or any(r < 1 for r in self.ranks):
            raise ValueError(f"{self.name}: ranks must be positive world sizes")
        keys = config_keys()
        for key in [*self.grid, *self.set]:
            if key not in keys and key != "preset":  # a [grid] of presets (`train`)
                raise ValueError(f"{self.name}: config key {key!r} is not in keys.toml")
        if unknown := set(self.smoke) - {
            "params",
            "grid",
            "set",
            "ranks",
            "checks",
            "device",
            "launcher",
        }:
            raise ValueError(f"{self.name}: unknown [smoke] entries {sorted(unknown)}")

    def missing_inputs(self) -> list[str]:
        """One line per input file this run needs and does not have."""
        missing = []
        for var, what in self.inputs.items():
            path = os.environ.get(var, "")
            if not path:
                missing.append(f"{self.name}: set {var} to the path of {what}")
            elif not os.path.isfile(path):
                missing.append(f"{self.name}: {var}={path} is not a file (expected {what})")
        return missing

    @property
    def label(self) -> str:
        """``Fig. 8`` or ``guard: overhead``."""
        return f"Fig. {self.figure}" if self.figure else f"guard: {self.guard}"

    def gpus(self) -> int:
        """GPUs one run needs (0: runs on the CPU)."""
        return max(self.ranks) if self.device == "cuda" else 0

    def smoked(self) -> Scenario:
        """The ``--smoke`` variant: [smoke] merged over the scenario, on the CPU."""
        s = copy.deepcopy(self)
        for part in ("params", "grid", "set"):
            getattr(s, part).update(self.smoke.get(part, {}))
        s.ranks = self.smoke.get("ranks", [min(self.ranks[0], 2)])
        s.checks = self.smoke.get("checks", [])
        s.device = self.smoke.get("device", "cpu")
        s.launcher = self.smoke.get("launcher", self.launcher)
        return s


def load(name: str, folder: Path = SCENARIOS) -> Scenario:
    path = folder / f"{name}.toml"
    if not path.exists():
        raise ValueError(f"no scenario {name!r}; `python -m benchmarks list` names them")
    data = tomllib.loads(path.read_text())
    try:
        return Scenario(name=name, **data)
    except TypeError as e:  # an unknown top-level entry
        raise ValueError(f"{name}: {e}") from None


def names(folder: Path = SCENARIOS) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.toml") if p.stem != "keys")


def fitting_ranks(s: Scenario, gpus: int) -> list[int]:
    """The world sizes of ``s`` a machine of ``gpus`` GPUs runs (all of them on the CPU)."""
    return [r for r in s.ranks if r <= gpus] if s.device == "cuda" else list(s.ranks)


def plan(gpus: int, folder: Path = SCENARIOS) -> list[tuple[Scenario, bool, str]]:
    """Every scenario with whether a machine of ``gpus`` GPUs runs it, and how."""
    rows = []
    for n in names(folder):
        s = load(n, folder)
        fit = fitting_ranks(s, gpus)
        if not fit:
            rows.append((s, False, f"needs {min(s.ranks)} GPUs"))
        elif fit != s.ranks:
            rows.append((s, True, f"part: --ranks {','.join(map(str, fit))} of {s.ranks}"))
        elif s.device == "cuda" or (s.device == "any" and gpus):
            rows.append((s, True, f"{s.gpus() or 1} GPU(s)"))
        else:
            rows.append((s, True, "CPU"))
    return rows
