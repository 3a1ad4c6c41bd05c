"""A run's state between processes: checkpoints, resume, where the data stand.

Built from the ``checkpoint`` section. What a checkpoint holds: the tables
(`TableEntries`, resharded at any world size), the dense weights and Adam,
the balancer's state, the best evaluation of ``evaluation.keep_best``
(`freescale.state.best`) and where training stands in the data
(`freescale.state.position`).
"""

from __future__ import annotations

import sys
from typing import Any

from torch import Tensor, nn

from freescale.comm.rank_text import broadcast_text
from freescale.config import CheckpointSection
from freescale.state.checkpoint import (
    Checkpointer,
    check_resumable,
    find_checkpoint,
    read_manifest,
)
from freescale.state.data_record import DataRecord
from freescale.state.position import DataPosition, resume_record, resumed_source

# ``checkpoint.resume=auto``: the newest complete checkpoint in ``checkpoint.dir``
# if there is one, else a fresh start. One command line serves the first start
# and every restart, as an elastic job (torchrun --max-restarts) needs.
AUTO = "auto"


class DenseState:
    """The model's dense part as a ``state_dict`` object: equal on every rank,
    so one rank can save it (the tables are checkpointed by the collection)."""

    def __init__(self, model: nn.Module, embeddings: Any) -> None:
        self.model, self.embeddings = model, embeddings

    def state_dict(self) -> dict[str, Tensor]:
        """The model's state without the sharded tables (no collective)."""
        with self.embeddings.tables_left_out():
            return self.model.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.embeddings.tables_left_out():
            self.model.load_state_dict(state)


class RunState:
    """Restore (``resume``) and save (``dir``/``every``/``keep``) a run;
    ``best``: the run's `BestWeights` (``evaluation.keep_best``), else None."""

    def __init__(
        self,
        section: CheckpointSection,
        config: dict[str, Any],
        group: Any,
        world: int,
        batch_size: int,
        tables: Any,
        replicated: dict[str, Any],
        flush: Any,
        best: Any = None,  # (best.py imports this module's `DenseState`)
        source: Any = None,  # the run's data source: its part of every checkpoint (`DataRecord`)
    ) -> None:
        self.section, self.config = section, config
        self.world, self.batch_size = world, batch_size
        self.tables, self.flush, self.best = tables, flush, best
        self.replicated = {**replicated, "best": best} if best is not None else replicated
        data = None
        if source is not None:
            data = DataRecord(source, config["data"]["source"], batch_size)
        self.checkpoints = Checkpointer(
            section.dir, section.every, section.keep, config, group, data
        )
        self.group = group
        # Where training starts in the data (`restore` moves it), and how it continues.
        self.position = DataPosition(world_size=world)
        self.data_position = ""

    def restore(self, source: Any) -> tuple[int, Any]:
        """Load ``resume`` (if set, written at any world size): the first step
        to run and the source it reads from (`freescale.state.position`)."""
        resume = self._auto() if self.section.resume == AUTO else self.section.resume
        if not resume:
            return 0, source
        # The launcher checked it already; API users get the same one-line errors.
        # The files are checked by every rank together in `Checkpointer.load`.
        path = check_resumable(resume, self.config, verify=False)
        self.position = self.checkpoints.load(path, self.tables, self.replicated)
        rows = self.best.tables() if self.best is not None else None
        if rows is not None:  # the checkpoint held a best for this metric
            self.checkpoints.load_best(path, rows)
        source, self.data_position = resumed_source(source, self.position, self.world)
        check_world = getattr(source, "check_world", None)  # a source that cannot continue
        if check_world is not None:  # there says so here, before any step
            check_world(self.world, self.batch_size)
        return self.position.step, source

    def _auto(self) -> str:
        """``resume=auto``: rank 0 looks, every rank takes its answer, rank 0 says it."""
        found = find_checkpoint(self.section.dir) if self.checkpoints.rank == 0 else None
        resume = broadcast_text(str(found or ""), self.group, self.world)
        if self.checkpoints.rank == 0:
            if resume:
                step = read_manifest(found)["step"]
                line = f"resuming from {resume} (step {step})"
            else:
                line = f"no complete checkpoint in {self.section.dir!r}: starting at step 0"
            print(f"freescale: checkpoint.resume=auto: {line}", file=sys.stderr, flush=True)
        return resume

    def resumed(self) -> dict[str, Any]:
        """The summary's ``"resumed"`` entry (`position.resume_record`)."""
        return resume_record(self.position, self.data_position, self.world)

    def samples_before(self, step: int) -> int:
        """Samples (all ranks) consumed before ``step``, resumed runs included."""
        return self.position.samples_at(step, self.world, self.batch_size)

    def due(self, step: int) -> bool:
        return self.checkpoints.due(step)

    def save(self, next_step: int) -> None:
        """Checkpoint a run that continues at ``next_step`` (the tables made exact first)."""
        if self.checkpoints.directory is None:
            return
        self.flush()
        self.checkpoints.save(
            next_step,
            self.tables,
            self.replicated,
            self.samples_before(next_step),
            self.position.continued(self.world),
            self.best.tables() if self.best is not None else None,
        )
