"""Baseline training runs (paper §5 set-up): sync ("vanilla TorchRec") vs sdd.

    python benchmarks/train_baseline.py --preset h200-21k --nproc 2 \\
        --max-uih 8000,21000 --batch 32,128 --modes sync,sdd
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sweep

if __name__ == "__main__":
    sys.exit(
        sweep.script(
            __doc__, {"mode": "sync,sdd"}, "train-baseline", "Baseline training: sync vs sdd"
        )
    )
