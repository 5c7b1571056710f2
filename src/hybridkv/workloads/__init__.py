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

import os

from hybridkv.errors import brief_repr
from hybridkv.workloads.ideal import REPLAY_POLICIES, ideal_hit_tokens, replay_hit_tokens
from hybridkv.workloads.mooncake import load_mooncake_trace, trace_path
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


def load_workload(
    spec: str | os.PathLike[str], *, num_requests: int | None = None, seed: int = 0
) -> Workload:
    """``synthetic:NAME`` or a path (``str`` or :class:`os.PathLike`) to a Mooncake-format
    trace, cut to ``num_requests`` (None: all of a trace, 400 of a synthetic workload).

    Raises :class:`WorkloadError` for a ``spec`` of another type or an empty one, a
    ``num_requests`` that is not None or an integer >= 1, a ``seed`` that is not an integer,
    and whatever the trace or synthetic loader refuses."""
    if num_requests is not None and (
        not isinstance(num_requests, int) or isinstance(num_requests, bool) or num_requests < 1
    ):
        raise WorkloadError(
            f"workload: num_requests must be an integer >= 1 (or None: all of a trace, 400 of "
            f"a synthetic workload), got {brief_repr(num_requests)}"
        )
    if isinstance(spec, os.PathLike):
        return load_mooncake_trace(trace_path(spec), limit=num_requests)
    if not isinstance(spec, str):
        raise WorkloadError(
            "trace: expected a Mooncake-format trace file (a str or os.PathLike) or "
            f"synthetic:NAME, got {brief_repr(spec)}"
        )
    if not spec.strip():
        raise WorkloadError(
            "trace: got an empty name; give a Mooncake-format trace file or synthetic:NAME"
        )
    if spec.startswith("synthetic:"):
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise WorkloadError(f"workload: seed must be an integer, got {brief_repr(seed)}")
        opts = SyntheticOptions(num_requests=num_requests or 400, seed=seed)
        return synthetic_workload(spec.removeprefix("synthetic:"), opts)
    return load_mooncake_trace(spec, limit=num_requests)
