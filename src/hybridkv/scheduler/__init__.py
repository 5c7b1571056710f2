"""Continuous-batching scheduler over the cache manager (shared by the engine and simulator)."""

from __future__ import annotations

from hybridkv.scheduler.scheduler import Scheduler, SequenceState
from hybridkv.scheduler.types import (
    ADMISSION_POLICIES,
    FinishReason,
    RequestOutput,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerError,
    SchedulerOutput,
)

__all__ = [
    "ADMISSION_POLICIES",
    "FinishReason",
    "RequestOutput",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerError",
    "SchedulerOutput",
    "SequenceState",
]
