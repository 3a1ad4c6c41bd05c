"""The one report format: a markdown page and a JSON-lines file per scenario run.

``NAME.jsonl`` (schema ``SCHEMA``): the first line is the header, then one
line per row, then one per check::

    {"kind": "header", "schema": 1, "scenario": ..., "label": "Fig. 8", "title": ...,
     "date": "2026-12-03T07:00:00", "machine": ..., "versions": {...}, "build": ...,
     "command": ..., "smoke": false, "files": [...]}
    {"kind": "row", ...measured numbers...}
    {"kind": "check", "name": ..., "pass": true, "detail": ...}

``NAME.md`` shows the header as a list, the rows as a table of the
scenario's metrics, extra sections the measure wrote, and the checks.
``index`` builds ``results/INDEX.md`` from the headers alone.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

SCHEMA = 1
HEADER_KEYS = ("scenario", "label", "title", "date", "machine", "versions", "build", "command")
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def build_commit() -> str:
    """``FREESCALE_BUILD`` (set on machines without the git history), else git's
    short HEAD (``+dirty`` with local changes), else ``unknown``."""
    if env := os.environ.get("FREESCALE_BUILD"):
        return env
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def versions() -> dict[str, str | None]:
    import torch

    def dist(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    nccl = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except (AttributeError, RuntimeError):
            nccl = None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": dist("triton"),
        "cuda": torch.version.cuda,
        "nccl": nccl,
    }


def machine() -> str:
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{n} x {torch.cuda.get_device_name(0)} ({platform.node()})"
    return f"CPU, {os.cpu_count()} cores ({platform.node()})"


def header(scenario: Any, argv: list[str] | None = None, smoke: bool = False) -> dict[str, Any]:
    argv = sys.argv if argv is None else argv
    prog = "python -m benchmarks" if argv and argv[0].endswith("__main__.py") else argv[0]
    return {
        "kind": "header",
        "schema": SCHEMA,
        "scenario": scenario.name,
        "label": scenario.label,
        "title": scenario.title,
        "date": dt.datetime.now().isoformat(timespec="seconds"),
        "machine": machine(),
        "versions": versions(),
        "build": build_commit(),
        "command": " ".join([prog, *map(shlex.quote, argv[1:])]),
        "smoke": smoke,
        "files": [],
    }


def _cell(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    if isinstance(value, dict | list):
        return json.dumps(value)
    return str(value)


def table(rows: list[dict[str, Any]], cols: list[str]) -> list[str]:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return lines


def markdown(head: dict[str, Any], rows: list[dict], columns: list[str], sections: list[str],
             checks: list[dict]) -> str:  # fmt: skip
    v = head.get("versions") or {}
    ver = ", ".join(f"{k} {v[k]}" for k in ("torch", "triton", "cuda", "nccl") if v.get(k))
    lines = [
        f"# {head['label']}: {head['title']}", "",
        f"- date: {head['date']}",
        f"- machine: {head['machine']}",
        f"- versions: {ver or 'unknown'}",
        f"- build: {head['build']}",
        f"- command: `{head['command']}`",
        *([f"- files: {', '.join(head['files'])}"] if head.get("files") else []),
        *(["- **smoke run: plumbing only, not a result**"] if head.get("smoke") else []),
        "",
    ]  # fmt: skip
    if rows and columns:  # no metrics named: the measure's own sections carry the table
        lines += [*table(rows, columns), ""]
    lines += sections
    if checks:
        lines += ["", "## Checks", "", "| check | pass | detail |", "|---|---|---|"]
        lines += [f"| {c['name']} | {'PASS' if c['pass'] else 'FAIL'} | {c.get('detail', '')} |"
                  for c in checks]  # fmt: skip
    return "\n".join(lines).rstrip() + "\n"


def write(out: Path, head: dict[str, Any], rows: list[dict], columns: list[str],
          sections: list[str] | None = None, checks: list[dict] | None = None) -> Path:  # fmt: skip
    """``out``.md and ``out``.jsonl; returns the markdown path."""
    out.parent.mkdir(parents=True, exist_ok=True)
    checks = checks or []
    records = [
        head,
        *({"kind": "row", **r} for r in rows),
        *({"kind": "check", **c} for c in checks),
    ]
    out.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    md = out.with_suffix(".md")
    md.write_text(markdown(head, rows, columns, sections or [], checks))
    return md


def read(path: Path) -> tuple[dict[str, Any], list[dict], list[dict]]:
    """Header, rows and checks of a ``.jsonl`` report; ValueError on a bad header."""
    records = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if not records or records[0].get("kind") != "header":
        raise ValueError(f"{path}: first line is not a header")
    head = records[0]
    if missing := [k for k in HEADER_KEYS if k not in head]:
        raise ValueError(f"{path}: header lacks {missing}")
    rows = [r for r in records[1:] if r.get("kind") == "row"]
    return head, rows, [r for r in records[1:] if r.get("kind") == "check"]


def _order(label: str, name: str) -> tuple:
    """Figures first, by number (2 before 10), then guards by name."""
    digits = re.match(r"\D*(\d*)", label).group(1)
    return (not label.startswith("Fig."), int(digits or 0) if label.startswith("Fig.") else 0,
            label, name)  # fmt: skip


def index(results: Path = RESULTS, scenarios: list[Any] | None = None) -> str:
    """INDEX.md: per figure / guard, its latest report, build, machine, date;
    scenarios (``scenario.Scenario``) without a report are listed as not run."""
    heads = {}
    for path in sorted(results.glob("*.jsonl")):
        head = read(path)[0]
        if not head.get("smoke"):
            heads[head["scenario"]] = (head["label"], path, head)
    for s in scenarios or []:
        heads.setdefault(s.name, (s.label, None, None))
    lines = [
        "# Benchmark results: index",
        "",
        "Generated by `python -m benchmarks index` from the report headers; do not edit.",
        "One report per scenario: its latest run (older ones are in git history).",
        "",
        "| figure / guard | scenario | report | build | machine | date |",
        "|---|---|---|---|---|---|",
    ]
    for name, (label, path, head) in sorted(heads.items(), key=lambda x: _order(x[1][0], x[0])):
        if head is None:
            lines.append(f"| {label} | `{name}` | not run yet | – | – | – |")
            continue
        md = path.with_suffix(".md").name
        lines.append(f"| {label} | `{name}` | [{md}]({md}) | {head['build']} | "
                     f"{head['machine']} | {head['date'][:10]} |")  # fmt: skip
    return "\n".join(lines) + "\n"
