"""Block pools by strategy: the registry :func:`make_block_pool` dispatches on."""

from __future__ import annotations

from hybridkv.cache.events import EventLog
from hybridkv.cache.pool_arena import ArenaPool
from hybridkv.cache.pool_base import BlockPool
from hybridkv.cache.pool_shared import OnePageArenaPool, PerGroupPools, UniformPool
from hybridkv.plan.layout import MemoryLayout, Strategy

__all__ = ["POOL_CLASSES", "make_block_pool"]

#: Pool class per layout strategy.
POOL_CLASSES: dict[Strategy, type[BlockPool]] = {
    Strategy.ARENA: ArenaPool,
    Strategy.UNIFORM: UniformPool,
    Strategy.POOLS: PerGroupPools,
}


def make_block_pool(
    layout: MemoryLayout, events: EventLog, *, arena_eviction: str = "chunk_lru"
) -> BlockPool:
    """The pool for ``layout.strategy``, with every block free and nothing cached.

    ``arena_eviction`` picks the arena's policy (see :mod:`hybridkv.cache.pool_arena`);
    other strategies ignore it.  An arena whose chunk is every group's block runs the
    default policy on :class:`OnePageArenaPool` (same behaviour, uniform's speed).  Raises
    PlanError for an unknown policy.
    """
    if layout.strategy is Strategy.ARENA:
        arena = layout.arena
        if (
            arena_eviction == "chunk_lru"
            and arena is not None
            and all(g.block_bytes == arena.chunk_bytes for g in layout.groups)
        ):
            return OnePageArenaPool(layout, events)
        return ArenaPool(layout, events, eviction=arena_eviction)
    return POOL_CLASSES[layout.strategy](layout, events)
