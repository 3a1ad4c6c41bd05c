"""Baseline training runs (paper §5 set-up): sync ("vanilla TorchRec") vs sdd.

    python benchmarks/train_baseline.py --preset h200-21k --nproc 2 \\
        --max-uih 8000,21000 --batch 32,128 --modes sync,sdd
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sweep


def main() -> int:
    p = sweep.parser(__doc__.split("\n\n")[0], {"mode": "sync,sdd"}, "train-baseline")
    sweep.run(p.parse_args(), "Baseline training: sync vs sdd")
    return 0


if __name__ == "__main__":
    sys.exit(main())
