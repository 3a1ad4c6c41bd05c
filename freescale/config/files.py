"""Config files: a run's configuration as TOML, read with ``tomllib`` and
written with ``tomli_w``.

A file holds the sections as tables (``[run]``, ``[data]``, ...) and the
factories' options as ``[data.options]`` / ``[model.options]`` (or as other
keys of ``[data]`` / ``[model]``, like ``--set data.KEY=VALUE``). It is read
onto a preset, and ``--set`` overrides go on top of it. Each key goes
through the same `ConfigBuilder` as ``--set`` does, with its TOML value
checked against the key's type instead of parsed from text, so a file's
errors are ``--set``'s, prefixed with the file and the line of the key.

`config_toml` is what ``--print-config``, a run directory's ``config.toml``
and a checkpoint's ``config.toml`` hold; `load_config` reads it back to an
equal config. TOML has no null: an option whose value is null cannot be
written (one line, before any rank starts).
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from collections.abc import Iterable
from typing import Any

import tomli_w

from freescale.config.builder import OPTION_SECTIONS, ConfigBuilder
from freescale.config.sections import SECTIONS
from freescale.config.train_config import TrainConfig


def config_toml(cfg: TrainConfig) -> str:
    """The config as TOML (``eval_only`` is no key: the command sets it)."""
    values = cfg.as_dict()
    values.pop("eval_only", None)
    for name, cls in SECTIONS.items():  # a float key holds a float (a preset may say 4_500)
        for f in dataclasses.fields(cls):
            if f.type == "float":
                values[name][f.name] = float(values[name][f.name])
    return toml_text(values)


def toml_text(values: dict[str, Any]) -> str:
    """``{section: {key: value}}`` as TOML; ValueError naming a null value."""
    _refuse_null(values, "")
    return tomli_w.dumps(values)


def _refuse_null(value: Any, where: str) -> None:
    if value is None:
        name = where.replace(".options.", ".", 1)  # data.options.x is set as data.x
        raise ValueError(f"{name} is null: TOML has no null; leave the option out instead")
    if isinstance(value, dict):
        for key, inner in value.items():
            _refuse_null(inner, f"{where}.{key}" if where else str(key))
    elif isinstance(value, list):
        for k, inner in enumerate(value):
            _refuse_null(inner, f"{where}[{k}]")


def load_config(
    path: str | os.PathLike,
    preset: str = "demo",
    overrides: Iterable[str] = (),
) -> TrainConfig:
    """The config of the TOML file ``path`` on ``preset``, ``overrides``
    (``section.key=value``) applied on top; ValueError (one line) naming the
    file, the line and the key of the first problem."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise ValueError(f"cannot read config {os.fspath(path)!r} ({e.strerror})") from None
    text = raw.decode("utf-8", errors="replace")
    where = _Locator(os.fspath(path), text)
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(where.syntax(str(e))) from None
    builder = ConfigBuilder(preset)
    for key, value, section in _items(doc):
        try:
            _set(builder, key, value, section)
        except ValueError as e:
            raise ValueError(where.at(section, key.partition(".")[2], str(e))) from None
    from_file = {key for key, _, _ in _items(doc)}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ValueError(f"override {item!r} must look like key=value")
        builder.set(key.strip(), text.strip())
        from_file.discard(key.strip())
    try:
        return builder.build()
    except ValueError as e:  # a section's own check: the line of the key it names
        named = re.search(rf"\b({'|'.join(SECTIONS)})\.(\w+)", str(e))
        if named is None:
            raise ValueError(f"{where.path}: {e}") from None
        if named.group(0) not in from_file:
            raise  # a --set's value
        raise ValueError(where.at(named.group(1), named.group(2), str(e))) from None


def _items(doc: dict[str, Any]) -> list[tuple[str, Any, str]]:
    """``(key, value, section)`` of a parsed file in its order, as ``--set`` keys:
    ``section.key`` in tables, shorthands at the top."""
    out = []
    for name, value in doc.items():
        if name in SECTIONS and isinstance(value, dict):
            out += [(f"{name}.{key}", inner, name) for key, inner in value.items()]
        else:
            out.append((name, value, name))
    return out


def _set(builder: ConfigBuilder, key: str, value: Any, section: str) -> None:
    if section not in SECTIONS and isinstance(value, dict):
        raise ValueError(f"unknown config section {key!r}; sections are {', '.join(SECTIONS)}")
    if key == f"{section}.options" and section in OPTION_SECTIONS:
        builder.set_options(section, value)
    else:
        builder.set_value(key, value)


class _Locator:
    """Lines of a config file, to name where a key was set."""

    def __init__(self, path: str, text: str) -> None:
        self.path, self.lines = path, text.splitlines()

    def syntax(self, message: str) -> str:
        found = re.search(r" \(at line (\d+), column (\d+)\)$", message)
        if found is None:
            return f"{self.path}: not TOML: {message}"
        line, column = found.groups()
        return f"{self.path}:{line}: not TOML: {message[: found.start()]} at column {column}"

    def at(self, section: str, key: str, message: str) -> str:
        line = self.line_of(section, key)
        return f"{self.path}:{line}: {message}" if line else f"{self.path}: {message}"

    def line_of(self, section: str, key: str) -> int | None:
        """The first line setting ``key`` in ``section``'s table (or its header
        for no key, or the ``[section.key]`` table), else a line naming both
        (dotted keys, inline tables)."""
        table = ""
        name = r"""["']?{}["']?"""
        header = re.compile(r"^\s*\[+\s*(?P<name>[^\]]+?)\s*\]")
        keyed = re.compile(rf"(^|[\s{{,.]){name.format(re.escape(key))}\s*=")
        sectioned = re.compile(rf"(^|\s){name.format(re.escape(section))}\s*[.=]")
        fallback = None
        for number, line in enumerate(self.lines, 1):
            head = header.match(line)
            if head:
                table = head.group("name").replace('"', "").replace("'", "")
                if table == (f"{section}.{key}" if key else section):  # [run], [run.KEY]
                    return number
                continue
            if not key and not table and sectioned.search(line):
                return number
            if key and keyed.search(line):
                if table in (section, f"{section}.options"):
                    return number
                if fallback is None and not table and sectioned.search(line):
                    fallback = number
        return fallback


def format_config(cfg: TrainConfig) -> str:
    """``--print-config``: the config as TOML, one table per section, which
    ``--config`` reads back (`load_config`)."""
    return config_toml(cfg)
