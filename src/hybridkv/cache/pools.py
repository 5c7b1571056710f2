"""Block pools by strategy: the registry :func:`make_block_pool` dispatches on."""

from __future__ import annotations

from hybridkv.cache.events import EventLog
from hybridkv.cache.pool_arena import ArenaPool
from hybridkv.cache.pool_base import DEFAULT_CHANCES, BlockPool, group_chances
from hybridkv.cache.pool_shared import FlatArenaPool, PerGroupPools, UniformPool
from hybridkv.plan.layout import MemoryLayout, Strategy

__all__ = ["POOL_CLASSES", "make_block_pool"]

#: Pool class per layout strategy.
POOL_CLASSES: dict[Strategy, type[BlockPool]] = {
    Strategy.ARENA: ArenaPool,
    Strategy.UNIFORM: UniformPool,
    Strategy.POOLS: PerGroupPools,
}


def make_block_pool(
    layout: MemoryLayout,
    events: EventLog,
    *,
    arena_eviction: str = "chunk_lru",
    second_chance: int = DEFAULT_CHANCES,
    window_chances: int | None = None,
) -> BlockPool:
    """The pool for ``layout.strategy``, with every block free and nothing cached.

    ``arena_eviction`` picks the arena's policy (see :mod:`hybridkv.cache.pool_arena`);
    other strategies ignore it.  An arena whose chunk is every group's block, or with one
    group, runs the default policy on :class:`FlatArenaPool` (uniform's free lists).
    ``second_chance``: spare a block that served a hit (or, in the chunked arena, an idle
    chunk holding one) once when it comes up for eviction (see
    :class:`~hybridkv.cache.pool_base.FreeListPool` and :class:`ArenaPool`); windowed groups
    take ``window_chances`` instead (:func:`~hybridkv.cache.pool_base.group_chances`).
    Raises PlanError for an unknown policy or a bad count.
    """
    caps = group_chances(layout, second_chance, window_chances)
    if layout.strategy is Strategy.ARENA:
        if arena_eviction == "chunk_lru" and FlatArenaPool.applies(layout):
            return FlatArenaPool(layout, events, chances=caps)
        return ArenaPool(layout, events, eviction=arena_eviction, chances=caps)
    if layout.strategy is Strategy.UNIFORM:
        return UniformPool(layout, events, chances=caps)
    return PerGroupPools(layout, events, chances=caps)
