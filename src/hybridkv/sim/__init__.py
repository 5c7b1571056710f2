"""Workload simulation: the real scheduler and cache manager with a cost-model runner."""

from __future__ import annotations

from hybridkv.sim.cost import (
    ACCELERATORS,
    Accelerator,
    ModelProfile,
    StepCostModel,
    load_model_config,
)
from hybridkv.sim.simulator import SimConfig, SimResult, SimulationError, TimelinePoint, simulate

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "ModelProfile",
    "SimConfig",
    "SimResult",
    "SimulationError",
    "StepCostModel",
    "TimelinePoint",
    "load_model_config",
    "simulate",
]
