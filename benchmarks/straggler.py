"""Straggler % vs load balancing (paper Fig. 8 on our hardware).

Sweeps balance = none / fbs / vbs / cost over max UIH and local batch size
with the reference model; also reports the balancer's own exposed time.

    python benchmarks/straggler.py --preset h200-21k --nproc 2 \\
        --max-uih 2000,8000,21000 --batch 32,128 --balance none,fbs,cost
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sweep


def main() -> int:
    defaults = {"max_uih": "2000,4000,8000,16000,21000", "batch_size": "32,64,128",
                "balance": "none,fbs,vbs,cost"}  # fmt: skip
    p = sweep.parser(__doc__.split("\n\n")[0], defaults, "straggler")
    sweep.run(p.parse_args(), "Straggler % and step time vs load balancing")
    return 0


if __name__ == "__main__":
    sys.exit(main())
