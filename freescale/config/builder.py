"""A config from a preset and ``section.key=value`` settings (``--set``, a file's keys).

``data=``, ``model=`` and ``balance=`` are shorthands of ``data.source``,
``model.factory`` and ``balance.method``; ``data.KEY`` / ``model.KEY``
outside the section's fields are options of the data / model factory. Any
other key is unknown: one line, naming the nearest key there is.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from freescale.config.presets import PRESETS
from freescale.config.sections import BUILTIN_MODEL, SECTIONS
from freescale.config.train_config import TrainConfig

SHORTHANDS = {"data": "data.source", "model": "model.factory", "balance": "balance.method"}
OPTION_SECTIONS = ("data", "model")  # their other keys are factory options


def parse_value(field_type: Any, key: str, text: str) -> Any:
    kind = field_type if isinstance(field_type, str) else getattr(field_type, "__name__", "")
    try:
        if kind == "bool":
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        if kind == "int":
            return int(text.replace("_", ""))
        if kind == "float":
            return float(text)
    except ValueError:
        raise ValueError(f"{key} expects a {kind}, got {text!r}") from None
    return text


def option_value(text: str) -> Any:
    """A factory option's value: a JSON literal (number, true, [1, 2], ...) or the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def known_keys() -> list[str]:
    """Every ``section.key`` (what ``--set`` accepts besides factory options)."""
    return [
        f"{name}.{f.name}"
        for name, cls in SECTIONS.items()
        for f in fields(cls)
        if f.name != "options"
    ]


def unknown_key(key: str, how: str = "see `freescale train --print-config`") -> str:
    """The one line for a key no section has: the nearest one there is, else the
    keys of its section, else the sections (a list of every key is too long)."""
    near = nearest_key(key)
    if near:
        return f"unknown config key {key!r}; did you mean {near!r}?"
    section = key.partition(".")[0]
    own = [k for k in known_keys() if k.startswith(section + ".")]
    if own:
        return f"unknown config key {key!r}; the keys of [{section}]: {', '.join(own)}"
    return (
        f"unknown config key {key!r}; keys are section.key, sections: {', '.join(SECTIONS)}; {how}"
    )


def nearest_key(key: str) -> str | None:
    """The key ``key`` most likely meant: one of the same last name (``steps``:
    ``run.steps``; ``emb_lr``: ``embeddings.lr``), else the most similar."""
    keys = [*known_keys(), *(f"model.{k}" for k in _builtin_model_options())]
    last = key.rpartition(".")[2]
    for name in (last, last.rpartition("_")[2]):
        same = [k for k in keys if k.rpartition(".")[2] == name]
        if same:
            return max(same, key=lambda k: difflib.SequenceMatcher(None, key, k).ratio())
    section, dot, _ = key.partition(".")
    own = [k.partition(".")[2] for k in keys if dot and k.startswith(section + ".")]
    if own:  # a known section: only its own keys (a shared prefix says nothing)
        near = difflib.get_close_matches(key.partition(".")[2], own, n=1, cutoff=0.7)
        return f"{section}.{near[0]}" if near else None
    near = difflib.get_close_matches(key, keys, n=1, cutoff=0.75)
    return near[0] if near else None


def _builtin_model_options() -> list[str]:
    from freescale.models.sequence import with_defaults

    return sorted(with_defaults({}))


def _types() -> dict[str, Any]:
    return {f"{n}.{f.name}": f.type for n, cls in SECTIONS.items() for f in fields(cls)}


class _Values:
    """A config being built: ``{section: {key: value}}`` plus what was set how."""

    def __init__(self, base: TrainConfig) -> None:
        self.values = base.as_dict()
        self.base_factory = base.model.factory
        self.set_options: dict[str, Any] = {}  # model options set explicitly

    def set(self, path: str, value: Any) -> None:
        section, _, key = path.partition(".")
        if key == "options":
            if section == "model":
                self.set_options.update(value)
            self.values[section]["options"] = {**self.values[section]["options"], **value}
        elif section == "model" and key != "factory":
            self.set_options[key] = value
            self.values["model"]["options"][key] = value
        else:
            self.values[section][key] = value

    def set_table_key(self, path: str, text: str) -> None:
        """``embeddings.tables.NAME.KEY=VALUE`` (NAME may hold dots: a module path)."""
        name, _, key = path.removeprefix("embeddings.tables.").rpartition(".")
        if not name:
            raise ValueError(
                f"{path!r} must look like embeddings.tables.NAME.KEY"
                " (KEY: placement, capacity, evict, admit_after)"
            )
        tables = {k: dict(v) for k, v in self.values["embeddings"]["tables"].items()}
        tables.setdefault(name, {})[key] = text
        self.values["embeddings"]["tables"] = tables

    def build(self) -> TrainConfig:
        model = self.values["model"]
        if model["factory"] != self.base_factory:
            # The preset's options were the built-in model's: another factory gets
            # only those set for it.
            model["options"] = dict(self.set_options)
        return TrainConfig.from_dict(self.values)


def build_config(preset: str = "demo", overrides: list[str] | None = None) -> TrainConfig:
    """A preset with ``section.key=value`` overrides applied; unknown keys are errors.

    ``data.KEY=VALUE`` / ``model.KEY=VALUE`` outside the section's fields become
    options of the data source / model factory (JSON literals, else strings)."""
    builder = ConfigBuilder(preset)
    for item in overrides or []:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must look like key=value")
        builder.set(key.strip(), text.strip())
    return builder.build()


class ConfigBuilder:
    """A preset with keys set one at a time: ``--set`` text (`set`) or typed
    values of a config file (`set_value`); each key's errors are raised as it
    is set, the sections' own checks at `build`."""

    def __init__(self, preset: str = "demo") -> None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; presets: {', '.join(PRESETS)}")
        self.types = _types()
        self.state = _Values(PRESETS[preset]())

    def set(self, key: str, text: str) -> None:
        """``key=text`` as on the command line (the text parsed by the key's type)."""
        self._apply(key, text, parse_value, option_value)

    def set_value(self, key: str, value: Any) -> None:
        """``key`` to a typed value (a config file's): its type must be the key's."""
        self._apply(key, value, typed_value, lambda v: v)

    def set_options(self, section: str, options: Any) -> None:
        """A factory's options as a whole table (``[data.options]`` of a file)."""
        if not isinstance(options, dict):
            raise ValueError(f"{section}.options must be a table of the factory's options")
        self.state.set(f"{section}.options", options)

    def build(self) -> TrainConfig:
        return self.state.build()

    def _apply(self, key: str, value: Any, parse: Callable, option: Callable) -> None:
        path = SHORTHANDS.get(key) or key
        section, _, name = path.partition(".")
        if section in OPTION_SECTIONS and name and path not in self.types:
            self.state.set(f"{section}.options", {name: option(value)})
            return
        if path.startswith("embeddings.tables."):
            self.state.set_table_key(path, value)
            return
        if path not in self.types:
            raise ValueError(unknown_key(key))
        value = parse(self.types[path], key, value)
        if path == "model.factory" and not value:
            value = BUILTIN_MODEL  # "model=" (empty): the built-in model
        self.state.set(path, value)


def typed_value(field_type: Any, key: str, value: Any) -> Any:
    """A config file's value for ``key``, checked against its type (an int
    where a float goes is fine; a bool is no number)."""
    kind = field_type if isinstance(field_type, str) else getattr(field_type, "__name__", "")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    fits = {
        "bool": isinstance(value, bool),
        "int": number and isinstance(value, int),
        "float": number,
        "str": isinstance(value, str),
    }
    if not fits.get(kind, True):
        raise ValueError(f"{key} expects a {kind}, got {value!r}")
    return float(value) if kind == "float" else value
