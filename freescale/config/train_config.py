"""`TrainConfig`: a run's configuration, one section per component."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any

from freescale.config.sections import (
    DROPOUT_KEYS,
    ITEM_TABLE,
    SECTIONS,
    BalanceSection,
    CheckpointSection,
    DataSection,
    DenseSection,
    EmbeddingsSection,
    EvaluationSection,
    FaultsSection,
    ModelSection,
    OutputSection,
    PipelineSection,
    RunSection,
)


@dataclass(frozen=True)
class TrainConfig:
    """A run's configuration: one section per component (see the module docstring).

    ``eval_only`` is no key: `freescale eval` sets it (restore, evaluate, no training)."""

    run: RunSection = field(default_factory=RunSection)
    data: DataSection = field(default_factory=DataSection)
    model: ModelSection = field(default_factory=ModelSection)
    embeddings: EmbeddingsSection = field(default_factory=EmbeddingsSection)
    dense: DenseSection = field(default_factory=DenseSection)
    balance: BalanceSection = field(default_factory=BalanceSection)
    pipeline: PipelineSection = field(default_factory=PipelineSection)
    evaluation: EvaluationSection = field(default_factory=EvaluationSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    faults: FaultsSection = field(default_factory=FaultsSection)
    output: OutputSection = field(default_factory=OutputSection)
    eval_only: bool = False

    def __post_init__(self) -> None:
        # The only checks across sections: each names both keys.
        if self.checkpoint.every and not (self.checkpoint.dir or self.output.dir):
            raise ValueError(
                "checkpoint.every needs checkpoint.dir (where to write them) or output.dir"
            )
        if self.checkpoint.resume == "auto" and not (self.checkpoint.dir or self.output.dir):
            raise ValueError(
                "checkpoint.resume=auto needs checkpoint.dir (where to look) or output.dir"
            )
        cap = self.balance.max_local_batch
        if cap and cap < self.run.batch_size:
            raise ValueError(
                f"balance.max_local_batch must be 0 or >= run.batch_size ({self.run.batch_size})"
            )
        dropout = [k for k in DROPOUT_KEYS if self.model.options.get(k)]
        if dropout and (self.dense.graphs or self.dense.compile):
            raise ValueError(
                f"model.{dropout[0]} needs eager dense blocks (dense.graphs and dense.compile off)"
            )
        if self.data.ids and self.data.raw_ids == "auto" and self.raw_item_ids():
            raise ValueError(
                f"data.ids remaps item ids to rows, but embeddings.tables.{ITEM_TABLE} is "
                "dynamic and takes the data's own ids: set data.raw_ids=off to remap them"
            )
        if self.evaluation.every_epochs and not self.run.epochs:
            raise ValueError("evaluation.every_epochs needs run.epochs (file data)")
        dynamic = sorted(self.embeddings.dynamics())
        if self.evaluation.keep_best and dynamic:  # its copy holds rows, not which id has each
            raise ValueError(
                f"evaluation.keep_best does not keep dynamic tables yet: set "
                f"embeddings.tables.{dynamic[0]}.capacity=0 or evaluation.keep_best=''"
            )
        if not self.run.epochs:  # else once the data gives the steps (`setup.resolve_epochs`)
            self.check_warmups(self.run.steps)

    def raw_item_ids(self) -> bool:
        """Whether the data keeps its own item ids (``data.raw_ids``; ``auto``: file
        data does where the item table is dynamic, `freescale.data.ids`)."""
        if self.data.raw_ids != "auto":
            return self.data.raw_ids == "on"
        from freescale.data.source import BUILTIN_KINDS

        kind = self.data.source.partition(":")[0]
        file_data = kind in BUILTIN_KINDS and kind != "synthetic"
        return file_data and ITEM_TABLE in self.embeddings.dynamics()

    def check_warmups(self, steps: int) -> None:
        """The lr warm-ups end before the run's ``steps`` do."""
        for name in ("dense", "embeddings"):
            warmup = getattr(self, name).lr_warmup
            if warmup >= steps:
                raise ValueError(f"{name}.lr_warmup ({warmup}) must be < the run's steps ({steps})")

    def as_dict(self) -> dict[str, Any]:
        """``{section: {key: value}}`` (what manifests and --print-config hold)."""
        out = {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}
        return {**out, "eval_only": self.eval_only} if self.eval_only else out

    @staticmethod
    def from_dict(values: dict[str, Any]) -> TrainConfig:
        """The inverse of `as_dict`; ValueError naming a key that is no section."""
        unknown = [k for k in values if k not in SECTIONS and k != "eval_only"]
        if unknown:
            raise ValueError(
                f"a config holds the sections {', '.join(SECTIONS)}; got {unknown[0]!r}"
            )
        sections = {k: SECTIONS[k](**v) for k, v in values.items() if k in SECTIONS}
        return TrainConfig(**sections, eval_only=bool(values.get("eval_only", False)))

    def with_values(self, **paths: Any) -> TrainConfig:
        """A copy with ``section__key=value`` (or ``section=Section``) replaced."""
        changes: dict[str, Any] = {}
        for path, value in paths.items():
            name, _, key = path.partition("__")
            if not key:
                changes[name] = value
                continue
            current = changes.get(name, getattr(self, name))
            changes[name] = replace(current, **{key: value})
        return replace(self, **changes)
