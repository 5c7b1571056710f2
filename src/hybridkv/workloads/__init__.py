"""Request streams for simulation and benchmarks: real traces and seeded synthetic ones.

Standard library only (no torch, numpy or matplotlib), so benchmark drivers running under
another interpreter can import it from ``src/``.  Modules, one concept each:

* :mod:`~hybridkv.workloads.types`      :class:`WorkloadRequest` (arrives at a time in ms),
  :class:`Workload`, :class:`WorkloadError`
* :mod:`~hybridkv.workloads.mooncake`   the Mooncake trace format (plain or gzip)
* :mod:`~hybridkv.workloads.synthetic`  seeded chat / agent / docs / mixed workloads (``simulate``)
* :mod:`~hybridkv.workloads.steps`      :class:`StepRequest`: arrives at a scheduler step, a
  follow-up only after its parent finished (the manager benchmarks' closed loop)
* :mod:`~hybridkv.workloads.multiturn`  seeded multi-turn workloads of step requests
* :mod:`~hybridkv.workloads.ideal`      hit bounds: unbounded, LRU and Belady replays
"""

from __future__ import annotations

from hybridkv.workloads.ideal import REPLAY_POLICIES, ideal_hit_tokens, replay_hit_tokens
from hybridkv.workloads.mooncake import load_mooncake_trace
from hybridkv.workloads.multiturn import (
    BranchingConfig,
    ConversationConfig,
    branching_workload,
    conversation_workload,
)
from hybridkv.workloads.steps import StepRequest, arrival_order, step_requests, step_summary
from hybridkv.workloads.synthetic import SYNTHETIC_WORKLOADS, SyntheticOptions, synthetic_workload
from hybridkv.workloads.types import Workload, WorkloadError, WorkloadRequest

__all__ = [
    "REPLAY_POLICIES",
    "SYNTHETIC_WORKLOADS",
    "BranchingConfig",
    "ConversationConfig",
    "StepRequest",
    "SyntheticOptions",
    "Workload",
    "WorkloadError",
    "WorkloadRequest",
    "arrival_order",
    "branching_workload",
    "conversation_workload",
    "ideal_hit_tokens",
    "load_mooncake_trace",
    "load_workload",
    "replay_hit_tokens",
    "step_requests",
    "step_summary",
    "synthetic_workload",
]


def load_workload(spec: str, *, num_requests: int | None = None, seed: int = 0) -> Workload:
    """``synthetic:NAME`` or a path to a Mooncake-format trace, cut to ``num_requests``."""
    if not spec.strip():
        raise WorkloadError(
            "trace: got an empty name; give a Mooncake-format trace file or synthetic:NAME"
        )
    if spec.startswith("synthetic:"):
        opts = SyntheticOptions(num_requests=num_requests or 400, seed=seed)
        return synthetic_workload(spec.removeprefix("synthetic:"), opts)
    return load_mooncake_trace(spec, limit=num_requests)
