"""Straggler % and QPS against world size, balanced vs not (paper Fig. 8c, Fig. 11).

One process per GPU with NCCL; world sizes are subsets of the machine's GPUs.

    python benchmarks/scaling.py --preset h200-21k --nproc 2,4,8 \\
        --max-uih 8000,21000 --batch 128 --balance none,fbs,cost
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sweep

DEFAULTS = {
    "nproc": "2,4,8",
    "max_uih": "8000,21000",
    "batch_size": "128",
    "balance": "none,fbs,cost",
}


if __name__ == "__main__":
    sys.exit(
        sweep.script(__doc__, DEFAULTS, "scaling", "Scaling: straggler % and QPS vs world size")
    )
