"""Request streams for simulation and benchmarks: real traces and seeded synthetic ones."""

from __future__ import annotations

from hybridkv.workloads.mooncake import load_mooncake_trace
from hybridkv.workloads.synthetic import SYNTHETIC_WORKLOADS, SyntheticOptions, synthetic_workload
from hybridkv.workloads.types import Workload, WorkloadError, WorkloadRequest

__all__ = [
    "SYNTHETIC_WORKLOADS",
    "SyntheticOptions",
    "Workload",
    "WorkloadError",
    "WorkloadRequest",
    "load_mooncake_trace",
    "load_workload",
    "synthetic_workload",
]


def load_workload(spec: str, *, num_requests: int | None = None, seed: int = 0) -> Workload:
    """``synthetic:NAME`` or a path to a Mooncake-format trace, cut to ``num_requests``."""
    if spec.startswith("synthetic:"):
        opts = SyntheticOptions(num_requests=num_requests or 400, seed=seed)
        return synthetic_workload(spec.removeprefix("synthetic:"), opts)
    return load_mooncake_trace(spec, limit=num_requests)
