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

DEFAULTS = {
    "max_uih": "2000,4000,8000,16000,21000",
    "batch_size": "32,64,128",
    "balance": "none,fbs,vbs,cost",
}


if __name__ == "__main__":
    sys.exit(
        sweep.script(__doc__, DEFAULTS, "straggler", "Straggler % and step time vs load balancing")
    )
