"""Markdown of benchmarks/sim_validate.py: calibration, per-run prediction vs measurement."""

from __future__ import annotations

import os
import platform

import numpy as np

from freescale.sim.timeline import CATEGORIES


def _f(v: float, nd: int = 2) -> str:
    return f"{v:.{nd}f}"


def render(table: list[dict], skipped: list[str], cal, command: str, day: str) -> str:
    m = cal.compute
    lines = [
        "# Simulator validation: predicted vs measured (held-out GPU runs)",
        "",
        f"- date: {day}; machine: {platform.node() or 'vm'}, {os.cpu_count()} cores (CPU only:"
        " the measurements are the H200 runs named below)",
        f"- command: `python {command}`",
        "- targets (issue 16): step time within 10 %, straggler % within 1.5 pp",
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
    return "\n".join(lines) + "\n"
