"""Per-kind managers and the registry the coordinator dispatches on (``spec.kind``)."""

from __future__ import annotations

from hybridkv.cache.kinds.attention import (
    ChunkedLocalManager,
    FullAttentionManager,
    SlidingWindowManager,
    WindowedManager,
)
from hybridkv.cache.kinds.base import GroupState, KindManager, StepOutputs, StepPlan
from hybridkv.cache.kinds.state import StateManager
from hybridkv.errors import PlanError
from hybridkv.specs import CacheKind

__all__ = [
    "KIND_MANAGERS",
    "ChunkedLocalManager",
    "FullAttentionManager",
    "GroupState",
    "KindManager",
    "SlidingWindowManager",
    "StateManager",
    "StepOutputs",
    "StepPlan",
    "WindowedManager",
    "manager_class",
]

#: Manager class per cache kind.  ``CacheKind.NONE`` layers form no group: nothing to manage.
KIND_MANAGERS: dict[CacheKind, type[KindManager]] = {
    kind: cls
    for cls in (FullAttentionManager, SlidingWindowManager, ChunkedLocalManager, StateManager)
    for kind in cls.kinds
}


def manager_class(kind: CacheKind) -> type[KindManager]:
    """The manager class for ``kind``.  Raises PlanError for kinds that form no group."""
    cls = KIND_MANAGERS.get(kind)
    if cls is None:
        valid = ", ".join(k.value for k in KIND_MANAGERS)
        raise PlanError(f"group spec kind: {kind.value!r} has no cache manager; valid: {valid}")
    return cls
