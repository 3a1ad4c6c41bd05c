"""Step metrics and evaluations as TensorBoard scalars (``output.tensorboard``).

Rank 0 writes, with the global step, the values of each step's metrics line
(`freescale.observe.metrics`) under the tags of `STEP_SCALARS`, and those of
an evaluation under ``eval/<name>``; the event files land in the run
directory, so ``tensorboard --logdir runs`` shows every run by its name. A
resumed run opens a new event file there with ``purge_step`` at its first
step: steps an interrupted run wrote past its checkpoint are dropped, as
they are run again.

Writing goes through ``torch.utils.tensorboard``, which needs the
``tensorboard`` package (the ``freescale[tensorboard]`` extra); it is
imported only when asked for.
"""

from __future__ import annotations

from typing import Any

from freescale.observe.timing import CATEGORIES

# tag -> the path of its value in a step's metrics line
STEP_SCALARS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("train/loss", ("loss",)),
    ("train/ne", ("ne",)),
    ("perf/step_ms", ("step_ms",)),
    ("perf/qps", ("qps",)),
    ("perf/mfu_pct", ("mfu_pct",)),
    ("perf/tflops", ("tflops",)),
    ("perf/straggler_pct", ("straggler_pct",)),
    ("perf/data_wait_ms", ("data_wait_ms",)),
    ("perf/collision_rows_pct", ("collision_rows_pct",)),
    ("perf/collision_ids_pct", ("collision_ids_pct",)),
    *((f"exposed_comm_ms/{c}", ("exposed_comm_ms", c)) for c in CATEGORIES),
)
EVAL_SCALARS = ("hr@10", "ndcg@10", "auc", "ne")
INSTALL = "pip install 'freescale[tensorboard]'"


def check_installed() -> None:
    """ValueError (one line) unless TensorBoard's writer can be imported."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError(
            f"output.tensorboard=true needs the tensorboard package: {INSTALL}"
        ) from None


class ScalarBoard:
    """TensorBoard scalars of a run in ``directory`` (empty: writes nothing).

    `start` says where the run starts: a resumed run purges the events of its
    first step and later (an attempt that died wrote them; this run writes them
    again), as the metrics file drops those lines."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.purge: int | None = None
        self.writer: Any = None  # opened at the first write

    def start(self, first_step: int) -> None:
        self.purge = first_step if first_step > 0 else None

    def write(self, record: dict[str, Any]) -> None:
        if not self.directory:
            return
        step = record["step"]
        if self.writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.directory, purge_step=self.purge, flush_secs=10)
        for tag, path in STEP_SCALARS:
            value = _lookup(record, path)
            if value is not None:
                self.writer.add_scalar(tag, value, step)
        for name in EVAL_SCALARS:
            value = record.get("eval", {}).get(name)
            if value is not None:
                self.writer.add_scalar(f"eval/{name}", value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _lookup(record: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = record
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value
