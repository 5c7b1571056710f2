"""Workload simulation: the real scheduler and cache manager with a cost-model runner."""

from __future__ import annotations

from hybridkv.sim.cost import (
    ACCELERATORS,
    Accelerator,
    ModelProfile,
    StepCostModel,
    load_model_config,
)
from hybridkv.sim.simulator import (
    Rejection,
    SimConfig,
    SimResult,
    SimulationError,
    TimelinePoint,
    plan_for,
    simulate,
)

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "ModelProfile",
    "Rejection",
    "SimConfig",
    "SimResult",
    "SimulationError",
    "StepCostModel",
    "TimelinePoint",
    "load_model_config",
    "plan_for",
    "simulate",
]
