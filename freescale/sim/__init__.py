"""Cluster simulator (layer 2): projections of straggler %, exposed communication
and QPS to world sizes we cannot measure. See docs/simulator.md.

- `ComputeModel`, `fit_compute_model`, `LinkModel`: cost models (`model`).
- `LengthSpec`, `synthetic_features`, `rank_features`: workloads (`workload`).
- `SimConfig`, `simulate`, `StepTimes`: the step timeline per mode (`timeline`).
"""

from freescale.sim.model import FEATURES, ComputeModel, LinkModel, fit_compute_model
from freescale.sim.timeline import CATEGORIES, MODES, SimConfig, StepTimes, simulate
from freescale.sim.workload import (
    Assign,
    LengthSpec,
    StepLengths,
    rank_features,
    synthetic_features,
    synthetic_step,
)

__all__ = [
    "CATEGORIES",
    "FEATURES",
    "MODES",
    "Assign",
    "ComputeModel",
    "LengthSpec",
    "LinkModel",
    "SimConfig",
    "StepLengths",
    "StepTimes",
    "fit_compute_model",
    "rank_features",
    "simulate",
    "synthetic_features",
    "synthetic_step",
]
