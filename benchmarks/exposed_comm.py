"""Exposed communication of `sync`, `sdd` and `freescale` (paper Fig. 9).

(a) against max UIH length, (b) against the collision rate at a fixed volume
(the synthetic data's ``step_overlap`` moves a share of each step's ids to
rows its neighbours do not read). One `freescale train` run per point; world
size is a parameter (gloo ranks on CPU, one GPU per rank with NCCL).

    python benchmarks/exposed_comm.py --nproc 2                       # CPU, demo data
    python benchmarks/exposed_comm.py --preset h200-21k --nproc 2,4,8 \\
        --max-uih 2000,8000,21000 --vary step_overlap=1,0.5,0.2,0

On CPU ranks the gloo collectives run on the host, like the compute: a
smaller exposed time there means the mode waits less, not that a GPU would
overlap the same amount.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sweep

DEFAULTS = {
    "nproc": "2",
    "max_uih": "32,64",
    "batch_size": "32",
    "mode": "sync,sdd,freescale",
    "balance": "none",
    "vary": ["step_overlap=1,0.5,0"],
}
PARTS = ("ids_a2a", "emb_a2a", "grad_a2a")
ON_CPU = """
On CPU (gloo) ranks every wait blocks the host, and the host is also what
computes: `freescale` moves the embedding waits out of forward and backward
(emb, grad) into the prefetch of the next step after forward (counted as ids:
the ids, mark and row exchanges of step i+1), where on a GPU they would run
beside the compute. The emb + grad columns show what the schedule takes off
the critical path; the totals and step times on CPU do not show what a GPU
gains (that is Fig. 9 on 2+ GPUs).
"""


def table(rows: list[dict]) -> list[str]:
    """Per point: exposed ids / emb / grad, their sum, the collision rate."""
    lines = [
        "", "## Exposed embedding communication", "",
        "| GPUs | max UIH | step_overlap | mode | ids ms | emb ms | grad ms | emb+grad ms "
        "| emb+grad vs sync | ids+emb+grad ms | vs sync | collision % rows | collision % ids "
        "| step ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    sync = {
        (r["nproc"], r["max_uih"], r.get("step_overlap")): r for r in rows if r["mode"] == "sync"
    }
    for r in rows:
        e = r["exposed_comm_ms"]
        total = sum(e[p] for p in PARTS)
        base = sync.get((r["nproc"], r["max_uih"], r.get("step_overlap")))
        ratio = total / sum(base["exposed_comm_ms"][p] for p in PARTS) if base else float("nan")
        eg = e["emb_a2a"] + e["grad_a2a"]
        # A sweep without sync points (campaign.py's fig9b-fs) has no baseline here.
        base_eg = base and base["exposed_comm_ms"]["emb_a2a"] + base["exposed_comm_ms"]["grad_a2a"]
        eg_ratio = eg / base_eg if base else float("nan")
        rows_pct, ids_pct = r.get("collision_rows_pct"), r.get("collision_ids_pct")
        lines.append(
            f"| {r['nproc']} | {r['max_uih']} | {r.get('step_overlap', '–')} | {r['mode']} | "
            + " | ".join(f"{e[p]:.3f}" for p in PARTS)
            + f" | {eg:.3f} | {eg_ratio:.2f} | {total:.3f} | {ratio:.2f} | "
            + f"{'–' if rows_pct is None else f'{rows_pct:.1f}'} | "
            + f"{'–' if ids_pct is None else f'{ids_pct:.1f}'} | {r['step_ms']:.2f} |"
        )
    return lines


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--report":  # rewrite OUT.md from OUT.json
        path = Path(sys.argv[2])
        data = json.loads(path.read_text())
        rows = data.pop("rows")
        sweep.report(path.with_suffix(""), data, rows)
        md = path.with_suffix(".md")
        md.write_text(md.read_text() + "\n".join(table(rows)) + "\n" + ON_CPU)
        return 0
    args = sweep.parser(__doc__.split("\n\n")[0], DEFAULTS, "exposed-comm").parse_args()
    rows = sweep.run(args, "Exposed communication: sync vs sdd vs freescale (Fig. 9)")
    md = Path(args.out).with_suffix(".md")
    md.write_text(md.read_text() + "\n".join(table(rows)) + "\n" + ON_CPU)
    return 0


if __name__ == "__main__":
    sys.exit(main())
