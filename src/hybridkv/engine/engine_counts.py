"""What :meth:`LLMEngine.stats() <hybridkv.engine.llm_engine.LLMEngine.stats>` sums up: the
engine's step counters (:data:`COUNTERS`) and the :class:`EngineStats` made of them, the cache
tracker's and the manager's numbers."""

from __future__ import annotations

from hybridkv.cache import KVCacheManager
from hybridkv.engine.metrics import CacheTracker, EngineStats, group_labels
from hybridkv.plan import MemoryLayout

__all__ = ["COUNTERS", "engine_stats"]

#: What the engine counts, step by step (its ``_counts`` keys).
COUNTERS = [
    "steps",
    "passes",
    "batch",
    "step_tokens",
    "prompt",
    "computed",
    "gen",
    "drafted",
    "accepted",
    "rewinds",
    "host",
    "disk",
    "moved",
]


def engine_stats(
    layout: MemoryLayout,
    counts: dict[str, int],
    tracker: CacheTracker,
    manager: KVCacheManager,
    *,
    preemptions: int,
    seconds: float,
    model_seconds: float,
) -> EngineStats:
    """The :class:`EngineStats` of an engine's ``counts`` (:data:`COUNTERS`), cache
    ``tracker`` and ``manager``."""
    c, t = counts, tracker
    manager_stats = manager.stats
    return EngineStats(
        groups=group_labels(layout),
        steps=c["steps"],
        forward_passes=c["passes"],
        max_batch_requests=c["batch"],
        max_step_tokens=c["step_tokens"],
        prompt_tokens=c["prompt"],
        computed_tokens=c["computed"],
        generated_tokens=c["gen"],
        seconds=seconds,
        model_seconds=model_seconds,
        admitted_tokens=t.admitted_tokens,
        prefix_hit_tokens=t.prefix_hit_tokens,
        query_tokens=manager_stats.query_tokens,
        group_hit_tokens=manager_stats.group_alone_hit_tokens,
        peak_blocks=tuple(t.peak_blocks),
        window_blocks_released=tuple(t.window_released),
        preemptions=preemptions,
        peak_usage=t.peak_usage,
        draft_tokens=c["drafted"],
        accepted_draft_tokens=c["accepted"],
        rollback_passes=c["rewinds"],
        host_hit_tokens=c["host"],
        disk_hit_tokens=c["disk"],
        moved_blocks=c["moved"],
    )
