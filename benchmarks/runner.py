"""Run scenarios: one at a time (``run``) or a machine's session (``session``).

A measure is ``measure(scenario, ctx) -> Result``; the runner gives it a
folder for raw output (per-step logs, traces: never committed), writes the
one report (``report.write``), evaluates the scenario's checks on the rows,
and returns the exit status (1 when a check fails). Scenarios with
``launcher = "torchrun"`` are re-run under ``torchrun`` (one process per rank,
``ranks[0]`` of them); rank 0 writes the report.

Checks (``[[checks]]`` in a scenario), each over the rows:

- ``{kind = "max", metric = M, limit = X}``: every row's M <= X (``"min"``: >= X);
- ``{kind = "below", metric = M, axis = A, reference = R, values = [...]}``:
  a row with A in values has a smaller M than the row with A = R that agrees
  on every other axis (with ``factor = F``: M <= F x that row's M);
- ``{kind = "baseline", metric = M, file = F, match = [...], tolerance = T}``:
  M <= the baseline row's M + T (F: a report's .jsonl, or a JSON with "rows");
- ``{kind = "true", field = F}``: every row's F is true (rows where F is null are skipped).

Any check may add ``where = {KEY = VALUE, ...}``: it then looks only at the rows
with those values (e.g. MFU >= 25 % at UIH 21000, batch 128 alone).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import report
from .scenario import Scenario, fitting_ranks, load


@dataclass
class Ctx:
    out: Path  # report stem: out.md, out.jsonl, out.png
    raw: Path  # raw per-step logs and traces, not committed
    smoke: bool = False


@dataclass
class Result:
    rows: list[dict[str, Any]]
    sections: list[str] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)  # plots beside the report


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(s: Scenario, argv: list[str]) -> list[str]:
    n = s.ranks[0]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={n}", "-m", "benchmarks", *argv]  # fmt: skip


def run(name: str, smoke: bool = False, out: Path | None = None,
        argv: list[str] | None = None, ranks: list[int] | None = None) -> int:  # fmt: skip
    """Run scenario ``name`` (only world sizes ``ranks`` if given); the report goes
    to ``out``/NAME.{md,jsonl}."""
    s = load(name)
    s = s.smoked() if smoke else s
    if ranks and not smoke:
        if not set(ranks) <= set(s.ranks):
            raise ValueError(f"{name}: --ranks {ranks} not among its world sizes {s.ranks}")
        s.ranks = list(ranks)
    if missing := s.missing_inputs():
        print("\n".join(missing), file=sys.stderr)
        return 2
    out = out or (Path(tempfile.mkdtemp(prefix="fs-smoke-")) if smoke else report.RESULTS)
    argv = sys.argv if argv is None else argv
    if s.launcher == "torchrun" and not under_torchrun():
        args = ["run", name, "--out", str(out), *(["--smoke"] if smoke else [])]
        args += ["--ranks", ",".join(map(str, s.ranks))] if ranks and not smoke else []
        return subprocess.run(torchrun_command(s, args)).returncode
    stem = out / name
    ctx = Ctx(out=stem, raw=out / f"{name}-raw", smoke=smoke)
    ctx.raw.mkdir(parents=True, exist_ok=True)
    measure = importlib.import_module(f".{s.measure}", __package__).measure
    head = report.header(s, argv, smoke)
    start = time.perf_counter()
    result: Result | None = measure(s, ctx)
    if result is None:  # a torchrun rank other than 0
        return 0
    head["seconds"] = round(time.perf_counter() - start, 1)
    head["files"] = [p.name for p in result.files]
    checks = [c for spec in s.checks for c in check(spec, result.rows)]
    md = report.write(stem, head, result.rows, s.metrics, result.sections, checks)
    for c in checks:
        print(f"check {c['name']}: {'PASS' if c['pass'] else 'FAIL'} {c.get('detail', '')}")
    print(json.dumps({"scenario": name, "report": str(md), "rows": len(result.rows),
                      "checks_failed": sum(not c["pass"] for c in checks)}))  # fmt: skip
    return 1 if any(not c["pass"] for c in checks) else 0


def session(names: list[str], out: Path, smoke: bool = False, gpus: int | None = None) -> int:
    """Several scenarios in a row on one machine (with ``gpus``: only the world
    sizes that fit), then their raw folders packed into one archive
    (``session-raw.tgz``); the status is the worst one."""
    status = 0
    for name in names:
        print(f"== {name}", flush=True)
        fit = fitting_ranks(load(name), gpus) if gpus is not None else None
        argv = ["python -m benchmarks", "run", name, "--out", str(out)]
        argv += ["--ranks", ",".join(map(str, fit))] if fit else []
        status = max(status, run(name, smoke, out, argv=argv, ranks=fit))
    raws = [p for p in sorted(out.glob("*-raw")) if p.is_dir()]
    if raws:
        with tarfile.open(out / "session-raw.tgz", "w:gz") as tar:
            for p in raws:
                tar.add(p, arcname=p.name)
    return status


def _num(row: dict, key: str) -> float | None:
    value = row.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _baseline_rows(path: str) -> list[dict]:
    p = Path(path) if Path(path).is_absolute() else report.ROOT / path
    if p.suffix == ".jsonl":
        return report.read(p)[1]
    return json.loads(p.read_text())["rows"]


def check(spec: dict[str, Any], rows: list[dict]) -> list[dict[str, Any]]:
    """The checks ``spec`` makes over ``rows`` (one per row or pair of rows)."""
    kind, metric = spec["kind"], spec.get("metric", spec.get("field", ""))
    if where := spec.get("where"):
        rows = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    out = []
    if kind in ("max", "min"):
        sign = "<=" if kind == "max" else ">="
        for r in rows:
            v = _num(r, metric)
            ok = v is not None and (v <= spec["limit"] if kind == "max" else v >= spec["limit"])
            out.append({"name": f"{metric} {sign} {spec['limit']}", "pass": ok,
                        "detail": f"{_point(r)}: {v}"})  # fmt: skip
    elif kind == "true":
        for r in rows:
            if r.get(metric) is not None:  # None: nothing to check on this row
                out.append({"name": metric, "pass": bool(r[metric]), "detail": _point(r)})
    elif kind == "below":
        axis, ref = spec["axis"], spec["reference"]
        for r in (r for r in rows if r.get(axis) in spec["values"]):
            others = {k: v for k, v in r.get("point", {}).items() if k != axis}
            base = [b for b in rows if b.get(axis) == ref
                    and all(b.get("point", {}).get(k) == v for k, v in others.items())]  # fmt: skip
            a, b = _num(r, metric), _num(base[0], metric) if base else None
            factor = spec.get("factor")
            ok = a is not None and b is not None and (a <= factor * b if factor else a < b)
            sign = f"<= {factor} x" if factor else "<"
            out.append({"name": f"{metric}: {r[axis]} {sign} {ref}", "pass": ok,
                        "detail": f"{_point(r)}: {a} vs {b}"})  # fmt: skip
    elif kind == "baseline":
        match, tol = spec["match"], spec.get("tolerance", 0.0)
        base = {tuple(b.get(k) for k in match): b for b in _baseline_rows(spec["file"])}
        for r in rows:
            b = base.get(tuple(r.get(k) for k in match))
            a, ref = _num(r, metric), _num(b, metric) if b else None
            ok = a is None or ref is None or a <= ref + tol  # nothing to compare: not a failure
            out.append({"name": f"{metric} <= baseline + {tol}", "pass": ok,
                        "detail": f"{_point(r)}: {a} vs {ref}"})  # fmt: skip
    else:
        raise ValueError(f"unknown check kind {kind!r}")
    return out


def _point(row: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in row.get("point", {}).items()) or "-"
