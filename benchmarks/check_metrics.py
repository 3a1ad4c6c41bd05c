"""Regression guard over a sweep's JSON (`sweep.py` output): fail loudly when
the metrics or the balancer regress.

    python benchmarks/check_metrics.py OUT.json [--max-data-wait 1.0]

Checks, per (world size, max UIH, batch, mode): every point's data wait
(worst rank, mean over measured steps) is at most ``--max-data-wait`` ms, and
``fbs`` / ``cost`` have a lower straggler % than ``none``. Prints one line per
check, exits 1 if any fails.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def checks(rows: list[dict], max_data_wait: float) -> list[tuple[str, bool]]:
    out = []
    for r in rows:
        name = f"W={r['nproc']} uih={r['max_uih']} B={r['batch_size']} {r['mode']} {r['balance']}"
        wait = r.get("data_wait_ms_max", r["data_wait_ms"])
        out.append((f"{name}: data wait {wait:.3f} ms <= {max_data_wait}", wait <= max_data_wait))
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        key = (r["nproc"], r["max_uih"], r["batch_size"], r["mode"])
        groups.setdefault(key, {})[r["balance"]] = r
    for key, by_balance in groups.items():
        none = by_balance.get("none")
        for bal in ("fbs", "cost"):
            if none is None or bal not in by_balance:
                continue
            a, b = by_balance[bal]["straggler_pct"], none["straggler_pct"]
            out.append((f"W={key[0]} uih={key[1]} B={key[2]} {key[3]}: straggler {bal} "
                        f"{a:.2f}% < none {b:.2f}%", a < b))  # fmt: skip
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_json")
    p.add_argument("--max-data-wait", type=float, default=1.0)
    args = p.parse_args()
    rows = json.loads(Path(args.sweep_json).read_text())["rows"]
    results = checks(rows, args.max_data_wait)
    for text, ok in results:
        print(f"{'ok  ' if ok else 'FAIL'} {text}")
    return 0 if results and all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
