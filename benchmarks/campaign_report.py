"""The campaign's figure reports (issue 19), from its part archives (campaign.py).

    python benchmarks/campaign_report.py OUT DIR [DIR ...]   # archives under DIRs -> OUT

Reads every sweep JSON, per-step log, bandwidth and interference report the
parts packed, and writes ``campaign-report-<date>.{md,json}`` plus plots:

- Fig. 8: straggler % and step time per balancer, and its reduction over none;
- Fig. 9: exposed ids / emb / grad per mode, the reduction over `sync`, and
  for (b) a least-squares line of freescale's exposed emb + grad against the
  measured collision rate (slope, intercept, R^2);
- Fig. 11: exposed communication per category, QPS, per-GPU QPS over the
  W = 1 run of the same mode (weak-scaling efficiency), the bubble
  (1 - mean rank compute / step), rank 0's GPU idle % from the trace;
  NE and loss against the step for sync / sdd / freescale, and how far apart;
- point 5: the AllToAll bandwidth of each network regime.

Targets are printed next to the numbers, never asserted: a miss is a finding.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from datetime import date
from pathlib import Path

import numpy as np

CATEGORIES = ("ids_a2a", "emb_a2a", "grad_a2a", "dense_allreduce", "meta", "balancer")
EMB = ("ids_a2a", "emb_a2a", "grad_a2a")


def load_sweeps(folder: Path) -> list[dict]:
    """Every sweep row under ``folder``, tagged with its sweep stem and regime."""
    rows = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "rows" not in data or "title" not in data:
            continue
        sweep = re.sub(r"-\d+(xH200|cpu)$", "", path.stem)
        regime = "sockets" if sweep.startswith("sock") else "nvlink"
        rows += [{**r, "sweep": sweep, "regime": regime} for r in data["rows"]]
    return rows


def _emb(r: dict) -> float:
    return sum(r["exposed_comm_ms"][c] for c in EMB)


def _eg(r: dict) -> float:
    return r["exposed_comm_ms"]["emb_a2a"] + r["exposed_comm_ms"]["grad_a2a"]


def _var(r: dict) -> str:
    return ",".join(f"{k}={r[k]}" for k in ("step_overlap", "zipf_alpha") if k in r) or "–"


def fig8(rows: list[dict]) -> tuple[list[str], list[dict]]:
    pts = [r for r in rows if r["sweep"].startswith("fig8")]
    lines = ["## Fig. 8: straggler % and step time per balancer", "",
             "| GPUs | max UIH | batch | balance | step ms | straggler % | none / this |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    out = []
    none = {(r["nproc"], r["max_uih"], r["batch_size"]): r for r in pts if r["balance"] == "none"}
    for r in sorted(pts, key=lambda r: (-r["nproc"], r["max_uih"], r["batch_size"])):
        base = none.get((r["nproc"], r["max_uih"], r["batch_size"]))
        ratio = base["straggler_pct"] / r["straggler_pct"] if base and r["straggler_pct"] else None
        out.append({k: r[k] for k in ("nproc", "max_uih", "batch_size", "balance", "step_ms",
                                      "straggler_pct")} | {"reduction": ratio})  # fmt: skip
        lines.append(f"| {r['nproc']} | {r['max_uih']} | {r['batch_size']} | {r['balance']} | "
                     f"{r['step_ms']:.1f} | {r['straggler_pct']:.2f} | "
                     f"{'–' if ratio is None else f'{ratio:.1f}×'} |")  # fmt: skip
    return lines, out


def fig9(rows: list[dict]) -> tuple[list[str], list[dict]]:
    """Exposed embedding communication per mode and its reduction over sync
    (same regime, W, max UIH, collision setting)."""
    pts = [r for r in rows if r["sweep"].startswith(("fig9", "sock9"))]
    key = lambda r: (r["regime"], r["nproc"], r["max_uih"], _var(r))  # noqa: E731
    sync = {key(r): r for r in pts if r["mode"] == "sync"}
    lines = ["## Fig. 9: exposed ids / emb / grad communication", "",
             "Target: freescale's emb + grad ≥ 10× below sync at ≤ 5 % collision "
             "(paper ≈ 9×).", "",
             "| regime | GPUs | max UIH | setting | mode | collision % rows | ids ms | emb ms "
             "| grad ms | emb+grad ms | sync / this (emb+grad) | sync / this (ids+emb+grad) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    out = []
    for r in sorted(pts, key=lambda r: (r["regime"], -r["nproc"], r["max_uih"], _var(r))):
        base, e = sync.get(key(r)), r["exposed_comm_ms"]
        eg = base and _eg(r) and _eg(base) / _eg(r)
        tot = base and _emb(r) and _emb(base) / _emb(r)
        out.append({"regime": r["regime"], "nproc": r["nproc"], "max_uih": r["max_uih"],
                    "setting": _var(r), "mode": r["mode"], "collision_rows_pct":
                    r.get("collision_rows_pct"), "emb_grad_ms": _eg(r), "ids_emb_grad_ms":
                    _emb(r), "sync_over_this_emb_grad": eg or None,
                    "sync_over_this": tot or None})  # fmt: skip
        cells = " | ".join(f"{e[c]:.2f}" for c in EMB)
        ratios = f"{f'{eg:.1f}×' if eg else '–'} | {f'{tot:.1f}×' if tot else '–'}"
        lines.append(f"| {r['regime']} | {r['nproc']} | {r['max_uih']} | {_var(r)} | {r['mode']} | "
                     f"{r.get('collision_rows_pct', 0):.1f} | {cells} | {_eg(r):.2f} | "
                     f"{ratios} |")  # fmt: skip
    return lines, out


def collision_fit(rows: list[dict]) -> list[dict]:
    """Per (regime, W): least squares of freescale's exposed emb + grad ms on
    the collision rate (%), over the Fig. 9b points (step_overlap, zipf_alpha)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["mode"] == "freescale" and r["sweep"].startswith(("fig9b", "fig9c", "sock9")):
            groups.setdefault((r["regime"], r["nproc"]), []).append(r)
    fits = []
    for (regime, w), pts in sorted(groups.items()):
        x = np.array([p.get("collision_rows_pct", 0.0) for p in pts])
        y = np.array([_eg(p) for p in pts])
        fit = {"regime": regime, "nproc": w, "points": len(pts), "x": x.tolist(), "y": y.tolist()}
        if len(pts) >= 2 and np.ptp(x) > 0:
            slope, icept = np.polyfit(x, y, 1)
            resid = y - (slope * x + icept)
            ss = float(((y - y.mean()) ** 2).sum())
            fit |= {"slope_ms_per_pct": float(slope), "intercept_ms": float(icept),
                    "r2": 1 - float((resid**2).sum()) / ss if ss > 0 else 1.0}  # fmt: skip
        fits.append(fit)
    return fits


def fig11(rows: list[dict]) -> tuple[list[str], list[dict]]:
    pts = [r for r in rows if r["sweep"].startswith(("fig11", "sock11"))
           and not r["sweep"].startswith("fig11-ne")]  # fmt: skip
    w1 = {r["mode"]: r for r in pts if r["nproc"] == 1}
    sync = {(r["regime"], r["nproc"]): r for r in pts if r["mode"] == "sync"}
    lines = ["## Fig. 11: end to end", "",
             "Targets: exposed communication ≥ 90 % below sync; weak-scaling efficiency "
             "(per-GPU QPS at W over the W = 1 run of the same mode) ≥ 97 %; bubble "
             "(1 − mean rank compute / step) ≤ 2–3 %.", "",
             "| regime | GPUs | sweep | mode | balance | step ms | QPS | per-GPU QPS | efficiency "
             "% | bubble % | exposed ms | vs sync | " + " | ".join(CATEGORIES)
             + " | GPU idle % |", "|" + "---|" * (13 + len(CATEGORIES))]  # fmt: skip
    out = []
    for r in sorted(pts, key=lambda r: (r["regime"], -r["nproc"], r["sweep"], r["mode"])):
        exposed = sum(r["exposed_comm_ms"].values())
        base = sync.get((r["regime"], r["nproc"]))
        base_ms = sum(base["exposed_comm_ms"].values()) if base else 0.0
        below = 100 * (1 - exposed / base_ms) if base_ms > 0 else None
        one = w1.get(r["mode"])
        eff = 100 * r["qps"] / r["nproc"] / one["qps"] if one and r["nproc"] > 1 else None
        bubble = 100 * (1 - r["compute_ms_mean"] / r["step_ms"])
        idle = r.get("trace", {}).get("gpu_idle_pct")
        out.append({"regime": r["regime"], "nproc": r["nproc"], "sweep": r["sweep"],
                    "mode": r["mode"], "balance": r["balance"], "step_ms": r["step_ms"],
                    "qps": r["qps"], "efficiency_pct": eff, "bubble_pct": bubble,
                    "exposed_ms": exposed, "exposed_below_sync_pct": below,
                    "gpu_idle_pct": idle})  # fmt: skip
        lines.append(
            f"| {r['regime']} | {r['nproc']} | {r['sweep']} | {r['mode']} | {r['balance']} | "
            f"{r['step_ms']:.1f} | {r['qps']:.0f} | {r['qps'] / r['nproc']:.0f} | "
            f"{'–' if eff is None else f'{eff:.1f}'} | {bubble:.1f} | {exposed:.2f} | "
            f"{'–' if below is None else f'{-below:+.0f} %'} | "
            + " | ".join(f"{r['exposed_comm_ms'][c]:.2f}" for c in CATEGORIES)
            + f" | {'–' if idle is None else f'{idle:.1f}'} |"
        )
    return lines, out


def ne_curves(folder: Path) -> dict:
    """Per-step train NE and loss of the NE runs, and the largest loss gap to sync."""
    curves = {}
    for path in sorted(folder.glob("fig11-ne-*-steps/*.jsonl")):
        m = re.search(r"mode(\w+?)-balance(\w+?)\.jsonl", path.name)
        if m:
            recs = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
            curves[m.group(1)] = {"ne": [r["ne"] for r in recs], "loss": [r["loss"] for r in recs]}
    out: dict = {"curves": curves}
    if "sync" in curves:
        ref = curves["sync"]["loss"]
        out["max_abs_loss_diff_vs_sync"] = {
            k: max((abs(a - b) for a, b in zip(v["loss"], ref, strict=False)), default=0.0)
            for k, v in curves.items()
        }
    out["final_ne_mean_last_50"] = {k: float(np.mean(v["ne"][-50:])) for k, v in curves.items()}
    return out


def bandwidth(folder: Path) -> list[dict]:
    """AllToAll GB/s at the largest message of each bw-<regime>-<tag>.md."""
    out = []
    for md in sorted(folder.glob("bw-*.md")):
        text = md.read_text().split("## all_to_all", 1)[-1]
        cells = re.findall(r"^\| (\d+ [KM]iB) \| [\d.]+ / ([\d.]+) \|", text, re.M)
        if cells:
            size, gbps = cells[-1]
            out.append({"file": md.name, "regime": md.stem.split("-")[1], "bytes": size,
                        "all_to_all_GBps": float(gbps)})  # fmt: skip
    return out


def plots(folder: Path, out: Path, fits: list[dict], ne: dict) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing (pip install .[bench]): no plots", file=sys.stderr)
        return []
    made = []
    if fits:
        fig, ax = plt.subplots(figsize=(6, 4))
        for f in fits:
            ax.plot(f["x"], f["y"], "o", label=f"{f['regime']} W={f['nproc']}")
            if "slope_ms_per_pct" in f:
                xs = np.linspace(0, max(f["x"]), 2)
                ax.plot(xs, f["slope_ms_per_pct"] * xs + f["intercept_ms"], "--")
        ax.set(xlabel="collision % (rows)", ylabel="freescale exposed emb+grad ms/step",
               title="Fig. 9b: exposed vs collision")  # fmt: skip
        ax.legend(fontsize="small")
        made.append(_save(fig, plt, out.parent / f"{out.name}-fig9b.png"))
    if ne.get("curves"):
        fig, ax = plt.subplots(figsize=(7, 4))
        for mode, c in ne["curves"].items():
            ne_vals = np.array(c["ne"], dtype=float)
            k = min(20, len(ne_vals))
            smooth = np.convolve(ne_vals, np.ones(k) / k, mode="valid")
            ax.plot(range(k - 1, len(ne_vals)), smooth, label=mode)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set(xlabel="step", ylabel=f"train NE (moving mean of {k})", title="Fig. 11: NE")
        ax.legend()
        made.append(_save(fig, plt, out.parent / f"{out.name}-ne.png"))
    return made


def _save(fig, plt, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_report(out_dir: Path, sources: list[Path], day: str) -> int:
    """Unpack the archives of ``sources``, write the report into ``out_dir``; rc."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from campaign import unpack_all

    work = out_dir / "report-input"
    found = unpack_all(sources, work)
    try:
        rows = load_sweeps(work)
        l8, t8 = fig8(rows)
        l9, t9 = fig9(rows)
        fits = collision_fit(rows)
        l11, t11 = fig11(rows)
        ne, bw = ne_curves(work), bandwidth(work)
        stem = out_dir / f"campaign-report-{day}"
        pngs = plots(work, stem, fits, ne)
        lines = [f"# Campaign report ({day})", "",
                 f"- archives: {', '.join(p.name for p in found) or 'none'}",
                 f"- sweep points: {len(rows)}", "", *l8, "", *l9, "",
                 "### Fig. 9b: freescale exposed emb + grad vs collision rate", "",
                 "| regime | GPUs | points | slope ms / % | intercept ms | R² |",
                 "|---|---|---|---|---|---|"]  # fmt: skip
        for f in fits:
            lines.append(f"| {f['regime']} | {f['nproc']} | {f['points']} | "
                         + (f"{f['slope_ms_per_pct']:.3f} | {f['intercept_ms']:.2f} | "
                            f"{f['r2']:.3f} |" if "r2" in f else "– | – | – |"))  # fmt: skip
        lines += ["", *l11, "", "### NE vs step (fig11-ne)", ""]
        for mode, v in ne.get("final_ne_mean_last_50", {}).items():
            gap = ne.get("max_abs_loss_diff_vs_sync", {}).get(mode)
            lines.append(f"- {mode}: mean train NE of the last 50 steps {v:.4f}"
                         + ("" if gap is None else f"; max |loss − sync| {gap:.2e}"))  # fmt: skip
        lines += [
            "",
            "## Point 5: AllToAll bandwidth per regime (largest message)",
            "",
            "| file | regime | bytes per rank | GB/s |",
            "|---|---|---|---|",
        ]
        lines += [f"| {b['file']} | {b['regime']} | {b['bytes']} | {b['all_to_all_GBps']:.2f} |"
                  for b in bw]  # fmt: skip
        lines += ["", *(f"![{p.stem}]({p.name})" for p in pngs)]
        stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        ne_small = {k: v for k, v in ne.items() if k != "curves"}
        stem.with_suffix(".json").write_text(json.dumps(
            {"fig8": t8, "fig9": t9, "fig9b_fit": fits, "fig11": t11, "ne": ne_small,
             "bandwidth": bw}, indent=1))  # fmt: skip
        for f in work.glob("fig10-*.md"):
            shutil.copy(f, out_dir / f.name)
    finally:
        shutil.rmtree(work)
    return 0


def main() -> int:
    if len(sys.argv) < 3:
        print("usage: campaign_report.py OUT DIR [DIR ...]", file=sys.stderr)
        return 2
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    return write_report(out, [Path(p) for p in sys.argv[2:]], str(date.today()))


if __name__ == "__main__":
    sys.exit(main())
