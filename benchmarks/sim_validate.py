"""Simulator validation: fit on some measured GPU runs, predict the others.

One command re-validates whenever new measured runs land:

    python -m benchmarks run sim-validate

It reads every per-step log ``*-steps/*.jsonl`` of a GPU run in the step
archives named by ``steps`` (packed per GPU session; CPU runs are listed and
skipped), fits the calibration on the FIT runs below, predicts every other
run with `freescale.sim.simulate`, and writes the report and
``sim-validate-calibration.json`` beside it (the ``sim-project`` input).

Per-rank features: a run's logged ``rank_features`` when present, else rebuilt
from the synthetic data (a pure function of the sample index; checked against
the logged ``items`` of every step). Runs planned by ``none`` and ``fbs`` are
rebuilt exactly; ``cost`` plans depend on the online fit of measured times, so
they are replayed with the calibrated model as the partitioner's cost model
(an approximation, flagged in the table); ``vbs`` plans follow AutoTune's
shares, which the logs do not hold: skipped.

Fit: compute coefficients + jitter on all (rank, step) points of FIT; fixed
per-category exposure from the W = 1 FIT runs; the effective intra-node link
(α–β) from the 2-GPU FIT runs' exposed ids and embedding AllToAll minus the
W = 1 fixed part; inter-node from the paper's published figure (labelled).
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from freescale.balance import (
    CostModel,
    CostModelConfig,
    RuntimeInfo,
    WorldLengths,
    resolve_partitioner,
)
from freescale.config import build_config
from freescale.pipeline.setup import make_source
from freescale.sim import ComputeModel, SimConfig, simulate
from freescale.sim.calibrate import (
    PUBLISHED_LINKS,
    Calibration,
    MeasuredRun,
    compute_times,
    exposed_means,
    fit_runs,
    link_from_bandwidth,
    logged_features,
    read_steps,
)
from freescale.sim.timeline import CATEGORIES
from freescale.sim.workload import StepLengths, rank_features

from . import report
from .runner import Ctx, Result
from .scenario import Scenario

FIT = (
    "data-wait-1xH200-2026-12-01-final-steps/delay0.jsonl",
    "data-wait-1xH200-2026-12-01-final-steps/delay-half.jsonl",
    "scaling-21k-2xH200-2026-11-29T2050-steps/nproc2-max_uih21000-batch_size128-modesync-balancenone.jsonl",
    "scaling-21k-2xH200-2026-11-29T2050-steps/nproc2-max_uih21000-batch_size128-modesync-balancefbs.jsonl",
)
# W = 1 logs named without their parameters: (W, batch, max UIH, mode, balance, warm-up).
W1_RUNS = {
    "data-wait-1xH200-2026-12-01": (1, 128, 21000, "sync", "none", 10),
    "data-wait-1xH200-2026-12-01-final": (1, 128, 21000, "sync", "none", 10),
    "freescale-w1-1xH200-2026-12-01": (1, 64, 21000, None, "none", 8),
}
DENSE_MB = 8.44  # h200 presets' dense parameters (2,110,209 fp32), the DDP all-reduce
EMB_DIM, EMB_BYTES = 256, 4  # item_emb rows: 256 fp32
TARGET_STEP_PCT, TARGET_STRAGGLER_PP = 10.0, 1.5


def run_params(path: Path) -> dict | None:
    pattern = r"nproc(\d+)-max_uih(\d+)-batch_size(\d+)-mode(\w+?)-balance(\w+?)\.jsonl"
    m = re.search(pattern, path.name)
    folder = path.parent.name.removesuffix("-steps")
    if m:
        w, uih, b, mode, balance = m.groups()
        p = {"W": int(w), "max_uih": int(uih), "B": int(b), "mode": mode, "balance": balance}
    elif folder in W1_RUNS:
        w, b, uih, mode, balance, _ = W1_RUNS[folder]
        mode = mode or path.stem.removeprefix("w1-").rstrip("2")
        p = {"W": w, "max_uih": uih, "B": b, "mode": mode, "balance": balance}
    else:
        return None
    p["warmup"] = report_warmup(path.parent.parent / f"{folder}.md", folder)
    return p


def report_warmup(md: Path, folder: str) -> int:
    if folder in W1_RUNS:
        return W1_RUNS[folder][5]
    m = re.search(r"--warmup (\d+)", md.read_text()) if md.exists() else None
    return int(m.group(1)) if m else 10


class Lengths:
    """Per-sample lengths of the h200 synthetic data, replayed once and cached."""

    def __init__(self) -> None:
        self.source = make_source(build_config("h200-21k", []))
        self.full: list[tuple[int, int, int]] = []  # (full UIH, candidates, content)

    def upto(self, n: int) -> None:
        for g in range(len(self.full), n):
            s = self.source.raw_sample(g, max_uih=10**9)
            self.full.append((len(s.uih_ids), len(s.cand_ids), int(np.sum(s.content_lengths))))

    def step(self, step: int, w: int, b: int, max_uih: int) -> tuple[StepLengths, int]:
        lo, hi = step * w * b, (step + 1) * w * b
        self.upto(hi)
        rows = np.asarray(self.full[lo:hi], dtype=np.int64)
        uih = np.minimum(rows[:, 0], max_uih)
        # content per candidate is not needed: give each sample one bucket of its total.
        ncand = rows[:, 1]
        clen = np.zeros(int(ncand.sum()), dtype=np.int64)
        clen[np.cumsum(ncand) - ncand] = rows[:, 2]
        return StepLengths((b,) * w, uih, ncand, clen), int(uih.sum() + ncand.sum())


def rebuild(rows, p, lengths: Lengths, model: ComputeModel | None) -> tuple[np.ndarray, str]:
    """``[S, W, 5]`` per-rank features of a run, and how they were obtained."""
    feats, matched = [], 0
    partition = None if p["balance"] == "none" else resolve_partitioner(p["balance"])
    cost = None
    if p["balance"] == "cost" and model is not None:
        cost = CostModel(CostModelConfig(prior=tuple(float(c) for c in model.coefficients)))
    for r in rows:
        step_l, items = lengths.step(r["step"], p["W"], p["B"], p["max_uih"])
        matched += items == r["items"]
        dest = None
        if partition is not None:
            world = WorldLengths(step_l.batch_sizes, torch.from_numpy(step_l.uih),
                                 torch.from_numpy(step_l.num_candidates),
                                 torch.from_numpy(step_l.candidate_lengths))  # fmt: skip
            dest = partition(world, RuntimeInfo(step=r["step"], cost_model=cost)).dest().numpy()
        feats.append(rank_features(step_l, dest))
    how = "rebuilt" if p["balance"] in ("none", "fbs") else "replayed (approx. plan)"
    if matched != len(rows):
        how += f", items match {matched}/{len(rows)}"
    return np.stack(feats), how


def measured_summary(rows: list[dict]) -> dict[str, float]:
    step = np.array([r["step_ms"] for r in rows])
    items = np.array([r["items"] for r in rows], dtype=float)
    out = {
        "step_ms": float(step.mean()),
        "compute_ms": float(compute_times(rows).mean()),
        "qps": float(items.sum() / (step.sum() / 1e3)),
        "straggler_pct": float(np.mean([r["straggler_pct"] for r in rows])),
        "data_wait_ms": float(np.mean([r.get("data_wait_ms", 0.0) for r in rows])),
    }
    out.update({f"{k}_ms": v for k, v in exposed_means(rows).items()})
    return out


def sim_config(cal: Calibration, p: dict, rows: list[dict]) -> SimConfig:
    kappa = np.mean([r.get("collision_rows_pct", 21.3) for r in rows]) / 100.0
    fixed = cal.fixed_ms if p["balance"] == "none" else cal.fixed_ms_balanced
    return SimConfig(
        mode=p["mode"], intra=cal.intra, inter=cal.inter, gpus_per_node=8,
        embedding_dim=EMB_DIM, embedding_bytes=EMB_BYTES, dense_mb=DENSE_MB,
        collision_share=float(kappa), fixed_ms=dict(fixed),
        forward_barrier=p["balance"] == "none" and p["W"] > 1,
    )  # fmt: skip


def calibrate(runs: dict[str, dict], bandwidth: Path) -> Calibration:
    fit = [runs[name] for name in FIT]
    measured = [MeasuredRun(r["rows"], r["feats"], r["p"]["balance"] != "none") for r in fit]
    cal = fit_runs(measured, PUBLISHED_LINKS["ib-paper"]["link"], EMB_DIM * EMB_BYTES)
    bw = bandwidth.read_text()
    cal.host = {b: link_from_bandwidth(bw, "all_to_all", b) for b in ("smfree-shm", "smfree-gloo")}
    cal.sources = {
        "compute": "fit on " + ", ".join(FIT),
        "intra": "effective NCCL AllToAll over NVLink, fitted on the 2-GPU FIT runs' exposed "
        "ids/emb AllToAll minus the W=1 fixed part (not a link bandwidth)",
        "inter": "PUBLISHED, not measured: " + PUBLISHED_LINKS["ib-paper"]["source"],
        "fixed_ms": "W=1 FIT runs' mean exposed time per category (collective code path)",
        "fixed_ms_balanced": "as fixed_ms; meta = the 2-GPU FIT fbs run's balancer + meta",
        "host": f"{bandwidth.name} all_to_all, >= 1 MB messages "
        "(host-staged smfree paths; not used by the NCCL runs validated here)",
    }
    return cal


def predict(run: dict, cal: Calibration, seed: int = 0) -> dict[str, float]:
    out = simulate(run["feats"], cal.compute, sim_config(cal, run["p"], run["rows"]), seed=seed)
    return out.summary()


def compare(run: dict, pred: dict) -> dict:
    meas = run["measured"]
    terms = {"compute": pred["compute_ms"] - meas["compute_ms"], "data_wait": -meas["data_wait_ms"]}
    terms.update({c: pred[f"{c}_ms"] - meas[f"{c}_ms"] for c in CATEGORIES})
    worst = max(terms, key=lambda k: abs(terms[k]))
    step_err = 100.0 * (pred["step_ms"] / meas["step_ms"] - 1.0)
    strag_err = pred["straggler_pct"] - meas["straggler_pct"]
    return {
        "step_err_pct": step_err,
        "straggler_err_pp": strag_err,
        "qps_err_pct": 100.0 * (pred["qps"] / meas["qps"] - 1.0),
        "pass": abs(step_err) <= TARGET_STEP_PCT and abs(strag_err) <= TARGET_STRAGGLER_PP,
        "terms_ms": terms,
        "largest_term": f"{worst} {terms[worst]:+.2f} ms",
    }


def load_runs(results: Path) -> tuple[dict[str, dict], list[str]]:
    runs, skipped = {}, []
    for path in sorted(results.glob("*-steps/*.jsonl")):
        name = f"{path.parent.name}/{path.name}"
        p = run_params(path)
        rows = read_steps(path)
        if p is None or "cpu" in path.parent.name:
            note = f"{path.parent.name}/: CPU (gloo) or unrecognised runs, not GPU measurements"
            if note not in skipped:
                skipped.append(note)
            continue
        if p["mode"] not in ("sync", "sdd", "freescale"):
            skipped.append(f"{name}: mode {p['mode']}")
            continue
        if p["balance"] == "vbs":  # its plan follows AutoTune's shares, fed by measured times
            skipped.append(f"{name}: vbs plans depend on AutoTune state the log does not hold")
            continue
        measured = [r for r in rows if r["step"] >= p["warmup"]]
        runs[name] = {"p": p, "all_rows": rows, "rows": measured}
    return runs, skipped


DEFAULTS = {"steps": ["benchmarks/results/steps-2026-11-29.tgz",
                      "benchmarks/results/steps-2026-12-01.tgz"],
            "bandwidth": "benchmarks/results/comm-bandwidth.md"}  # fmt: skip


def measure(s: Scenario, ctx: Ctx) -> Result:
    args = SimpleNamespace(**{**DEFAULTS, **s.params})
    for archive in args.steps:
        with tarfile.open(report.ROOT / archive) as tar:
            tar.extractall(ctx.raw, filter="data")
    runs, skipped = load_runs(ctx.raw)
    lengths = Lengths()
    for name in FIT:  # FIT first: their plans need no model
        r = runs[name]
        logged = logged_features(r["rows"])
        r["feats"], r["how"] = (logged, "logged") if logged is not None else rebuild(
            r["rows"], r["p"], lengths, None)  # fmt: skip
        r["measured"] = measured_summary(r["rows"])
    cal = calibrate(runs, report.ROOT / args.bandwidth)
    table = []
    for name, r in runs.items():
        if "feats" not in r:
            logged = logged_features(r["rows"])
            r["feats"], r["how"] = (logged, "logged") if logged is not None else rebuild(
                r["rows"], r["p"], lengths, cal.compute)  # fmt: skip
            r["measured"] = measured_summary(r["rows"])
        pred = predict(r, cal)
        table.append({"run": name, "role": "fit" if name in FIT else "held-out", **r["p"],
                      "features": r["how"], "steps": len(r["rows"]), "measured": r["measured"],
                      "predicted": pred, **compare(r, pred)})  # fmt: skip
    calibration = ctx.out.with_name(f"{ctx.out.name}-calibration.json")
    calibration.write_text(cal.to_json() + "\n")
    return Result(table, render(table, skipped, cal), [calibration])


def _f(v: float, nd: int = 2) -> str:
    return f"{v:.{nd}f}"


def render(table: list[dict], skipped: list[str], cal) -> list[str]:
    m = cal.compute
    lines = [
        "Predicted vs measured (held-out GPU runs). The simulator runs on the CPU; the"
        " measurements are the H200 runs named below.",
        "",
        "- targets: step time within 10 %, straggler % within 1.5 pp",
        "- step = mean compute + mean exposed (all categories) + data wait, measured and"
        " predicted alike; `meta` = count all-reduce + balancer (+ the forward barrier's wait)",
        "",
        "## Calibration",
        "",
        "| part | value | source |",
        "|---|---|---|",
        f"| compute a, s, b, c, d, e | {m.a:.3g} ms, {m.s:.3g}, {m.b:.3g}, {m.c:.3g}, {m.d:.3g},"
        f" {m.e:.3g} | {cal.sources['compute']} |",
        f"| jitter σ (per rank-step, lognormal) | {m.jitter_sigma:.4f} | residuals of that fit |",
        f"| intra-node link | α {cal.intra.alpha_ms:.4f} ms, β {cal.intra.beta_ms_per_mb:.5f}"
        f" ms/MB | {cal.sources['intra']} |",
        f"| inter-node link | α {cal.inter.alpha_ms:.4f} ms, β {cal.inter.beta_ms_per_mb:.5f}"
        f" ms/MB | {cal.sources['inter']} |",
        "| fixed exposed ms, unbalanced | "
        + ", ".join(f"{k} {v:.3f}" for k, v in cal.fixed_ms.items())
        + f" | {cal.sources['fixed_ms']} |",
        "| fixed exposed ms, balanced | "
        + ", ".join(f"{k} {v:.3f}" for k, v in cal.fixed_ms_balanced.items())
        + f" | {cal.sources['fixed_ms_balanced']} |",
    ]
    for name, link in cal.host.items():
        lines.append(
            f"| host tier {name} | α {link.alpha_ms:.3f} ms, β {link.beta_ms_per_mb:.4f} ms/MB"
            f" | {cal.sources['host']} |"
        )
    lines += [
        "",
        "## Step time, straggler %, QPS",
        "",
        "| run | role | W | B | max UIH | mode | balance | features | steps | step ms meas"
        " | pred | err % | straggler % meas | pred | err pp | QPS err %"
        " | largest term (pred − meas) | within target |",
        "|---" * 18 + "|",
    ]
    for r in table:
        ms, pr = r["measured"], r["predicted"]
        lines.append(
            f"| {r['run']} | {r['role']} | {r['W']} | {r['B']} | {r['max_uih']} | {r['mode']}"
            f" | {r['balance']} | {r['features']} | {r['steps']} | {_f(ms['step_ms'])}"
            f" | {_f(pr['step_ms'])} | {r['step_err_pct']:+.1f} | {_f(ms['straggler_pct'])}"
            f" | {_f(pr['straggler_pct'])} | {r['straggler_err_pp']:+.2f} | {r['qps_err_pct']:+.1f}"
            f" | {r['largest_term']} | {'yes' if r['pass'] else 'NO'} |"
        )
    lines += [
        "",
        "## Exposed communication per category, ms (measured → predicted), and data wait",
        "",
        "| run | compute | " + " | ".join(CATEGORIES) + " | data wait (not modelled) |",
        "|---" * (len(CATEGORIES) + 3) + "|",
    ]
    for r in table:
        ms, pr = r["measured"], r["predicted"]
        cells = [f"{_f(ms[f'{c}_ms'])} → {_f(pr[f'{c}_ms'])}" for c in CATEGORIES]
        lines.append(
            f"| {r['run']} | {_f(ms['compute_ms'])} → {_f(pr['compute_ms'])} | "
            + " | ".join(cells)
            + f" | {_f(ms['data_wait_ms'])} |"
        )
    held = [r for r in table if r["role"] == "held-out"]
    if held:
        step_err = np.array([abs(r["step_err_pct"]) for r in held])
        strag_err = np.array([abs(r["straggler_err_pp"]) for r in held])
        lines += [
            "",
            "## Summary (held-out runs only)",
            "",
            f"- {sum(r['pass'] for r in held)} of {len(held)} held-out runs within both targets;"
            f" step time within 10 %: {int((step_err <= 10).sum())}; straggler within 1.5 pp:"
            f" {int((strag_err <= 1.5).sum())}",
            f"- |step error| median {np.median(step_err):.1f} %, max {step_err.max():.1f} %;"
            f" |straggler error| median {np.median(strag_err):.2f} pp,"
            f" max {strag_err.max():.2f} pp",
        ]
        by_w = sorted({r["W"] for r in held})
        for w in by_w:
            sub = [r for r in held if r["W"] == w]
            lines.append(
                f"- W = {w}: {sum(r['pass'] for r in sub)}/{len(sub)} within targets; mean step"
                f" error {np.mean([r['step_err_pct'] for r in sub]):+.1f} %, mean straggler error"
                f" {np.mean([r['straggler_err_pp'] for r in sub]):+.2f} pp"
            )
    lines += ["", "## Not validated (skipped)", ""] + [f"- {s}" for s in skipped]
    return lines
