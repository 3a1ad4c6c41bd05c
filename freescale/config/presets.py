"""Named starting points of a run (``--preset``); keys set on top (`freescale.config.builder`)."""

from __future__ import annotations

from collections.abc import Callable

from freescale.config.recipes import sasrec_hstu, sasrec_sequence
from freescale.config.sections import (
    DataSection,
    DenseSection,
    EvaluationSection,
    ModelSection,
    RunSection,
)
from freescale.config.train_config import TrainConfig


def demo() -> TrainConfig:
    """The README demo: 2 gloo ranks on the CPU, a small model, long-tail data."""
    return TrainConfig(model=ModelSection(options={"dim": 32, "heads": 2, "layers": 1}))


def _h200(max_uih: int) -> TrainConfig:
    """GPU runs (one process per GPU): the paper's long-UIH regime, bf16 autocast."""
    return TrainConfig(
        run=RunSection(
            device="cuda", nproc=2, steps=60, warmup=10, batch_size=64, deterministic=False
        ),
        data=DataSection(
            num_items=10_000_000,
            max_uih=max_uih,
            length_median=4_500,
            length_sigma=0.55,
            length_cap=17_000,
            max_candidates=8,
            max_content=4,
        ),
        model=ModelSection(options={"dim": 256, "heads": 4, "layers": 4}),
        dense=DenseSection(amp="bf16"),
        evaluation=EvaluationSection(every=0),
    )


def h200_8k() -> TrainConfig:
    return _h200(8_000)


def h200_21k() -> TrainConfig:
    return _h200(21_000)


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "demo": demo,
    "h200-8k": h200_8k,
    "h200-21k": h200_21k,
    "sasrec-sequence": sasrec_sequence,  # docs/train-on-your-data.md
    "sasrec-hstu": sasrec_hstu,
}
