"""Turn a metrics JSON-lines file into a markdown summary and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from freescale.observe.timing import CATEGORIES


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    records = []
    try:
        f = open(path)  # noqa: SIM115 - closed below
    except OSError as e:
        raise ValueError(f"cannot read metrics {str(path)!r} ({e.strerror})") from None
    with f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not a JSON line ({e.msg})") from None
    if not records or "step" not in records[0]:
        raise ValueError(f"{path}: no step records (write one with --set output.metrics_path=...)")
    return records


# Step fields shown when every measured step has them: key, label, format.
THROUGHPUT = (
    ("step_tflop", "model TFLOP per step (all ranks)", ".4g"),
    ("tflops", "TFLOP/s per GPU", ".4g"),
    ("mfu_pct", "MFU %", ".2f"),
)


def markdown(records: list[dict[str, Any]], warmup: int, title: str) -> str:
    measured = [r for r in records if r["step"] >= warmup] or records

    def mean(get) -> float:
        return sum(get(r) for r in measured) / len(measured)

    evals = [r for r in records if "eval_ne" in r]
    lines = [
        f"# {title}",
        "",
        f"{len(records)} steps ({len(measured)} measured after {warmup} warm-up steps).",
        "",
        "| metric | mean per step |",
        "|---|---|",
        f"| step time (ms) | {mean(lambda r: r['step_ms']):.2f} |",
        f"| QPS (items/s) | {mean(lambda r: r['qps']):.0f} |",
        f"| straggler % | {mean(lambda r: r['straggler_pct']):.2f} |",
    ]
    for c in CATEGORIES:
        lines.append(f"| exposed {c} (ms) | {mean(lambda r, c=c: r['exposed_comm_ms'][c]):.3f} |")
    for key, label, form in THROUGHPUT:
        values = [r.get(key) for r in measured]
        if values and None not in values:  # a model that counts FLOPs (a known peak: MFU)
            lines.append(f"| {label} | {sum(values) / len(values):{form}} |")
    lines.append(f"| train NE (last step) | {records[-1]['ne']:.4f} |")
    if evals:
        lines.append(
            f"| held-out NE (first → last eval) | {evals[0]['eval_ne']:.4f} → "
            f"{evals[-1]['eval_ne']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def plot(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """PNG plots; needs matplotlib (the ``bench`` extra). Returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    counted = all(r.get("tflops") is not None for r in records)  # the model counts FLOPs
    fig, axes = plt.subplots(3 + counted, 1, figsize=(7, 9 + 3 * counted), sharex=True)
    axes[0].plot(steps, [r["ne"] for r in records], label="train NE (step)")
    evals = [r for r in records if "eval_ne" in r]
    if evals:
        axes[0].plot(
            [r["step"] for r in evals], [r["eval_ne"] for r in evals], "o-", label="held-out NE"
        )
    axes[0].set_ylabel("NE")
    axes[0].legend()
    axes[1].plot(steps, [r["straggler_pct"] for r in records])
    axes[1].set_ylabel("straggler %")
    bottom = [0.0] * len(records)
    for c in CATEGORIES:
        values = [r["exposed_comm_ms"][c] for r in records]
        if any(values):
            axes[2].bar(steps, values, bottom=bottom, label=c)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes[2].set_ylabel("exposed comm (ms)")
    axes[2].legend(fontsize="small")
    if counted:
        _throughput(axes[3], steps, records)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    out = out_dir / "metrics.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return [out]


def _throughput(ax: Any, steps: list[int], records: list[dict[str, Any]]) -> None:
    """MFU % per step where the peak is known, else the achieved TFLOP/s per GPU."""
    if all(r.get("mfu_pct") is not None for r in records):
        ax.plot(steps, [r["mfu_pct"] for r in records])
        ax.set_ylabel("MFU %")
    else:
        ax.plot(steps, [r["tflops"] for r in records])
        ax.set_ylabel("TFLOP/s per GPU")
