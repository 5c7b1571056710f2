"""Block pools by strategy: the registry :func:`make_block_pool` dispatches on."""

from __future__ import annotations

from hybridkv.cache.events import EventLog
from hybridkv.cache.pool_arena import ArenaPool
from hybridkv.cache.pool_base import (
    DEFAULT_CHANCES,
    BlockPool,
    check_eviction_order,
    group_chances,
)
from hybridkv.cache.pool_shared import FlatArenaPool, PerGroupPools, UniformPool
from hybridkv.errors import PlanError
from hybridkv.plan.layout import MemoryLayout, Strategy

__all__ = ["POOL_CLASSES", "check_eviction", "make_block_pool"]

#: Pool class per layout strategy.
POOL_CLASSES: dict[Strategy, type[BlockPool]] = {
    Strategy.ARENA: ArenaPool,
    Strategy.UNIFORM: UniformPool,
    Strategy.POOLS: PerGroupPools,
}


def check_eviction(layout: MemoryLayout, eviction: str, arena_eviction: str = "chunk_lru") -> None:
    """Raise :class:`PlanError` unless ``eviction`` is an order the pool of ``layout`` runs:
    ``"lru"`` everywhere, ``"2q"`` on free-list pools only (not the chunked arena)."""
    check_eviction_order(eviction)
    flat = arena_eviction == "chunk_lru" and FlatArenaPool.applies(layout)
    if eviction != "lru" and layout.strategy is Strategy.ARENA and not flat:
        raise PlanError(
            f"eviction: {eviction!r} runs on free-list pools (strategies uniform and pools, and "
            "arenas whose chunk is every group's block or with one group); this arena's chunks "
            "keep their own LRU (give lru)"
        )


def make_block_pool(
    layout: MemoryLayout,
    events: EventLog,
    *,
    arena_eviction: str = "chunk_lru",
    eviction: str = "lru",
    second_chance: int = DEFAULT_CHANCES,
    window_chances: int | None = None,
) -> BlockPool:
    """The pool for ``layout.strategy``, with every block free and nothing cached.

    ``arena_eviction`` picks the arena's policy (see :mod:`hybridkv.cache.pool_arena`);
    other strategies ignore it.  An arena whose chunk is every group's block, or with one
    group, runs the default policy on :class:`FlatArenaPool` (uniform's free lists).
    ``second_chance``: spare a block that served a hit (or, in the chunked arena, an idle
    chunk holding one) once when it comes up for eviction (see
    :class:`~hybridkv.cache.pool_freelist.FreeListPool` and :class:`ArenaPool`); windowed groups
    take ``window_chances`` instead (:func:`~hybridkv.cache.pool_base.group_chances`).
    ``eviction``: the free-list pools' order (``"lru"`` or ``"2q"``; see
    :class:`~hybridkv.cache.pool_freelist.FreeListPool`); the chunked arena has only its own.
    Raises PlanError for an unknown policy or a bad count.
    """
    check_eviction(layout, eviction, arena_eviction)
    caps = group_chances(layout, second_chance, window_chances)
    if layout.strategy is Strategy.ARENA:
        if arena_eviction == "chunk_lru" and FlatArenaPool.applies(layout):
            return FlatArenaPool(layout, events, chances=caps, eviction=eviction)
        return ArenaPool(layout, events, eviction=arena_eviction, chances=caps)
    if layout.strategy is Strategy.UNIFORM:
        return UniformPool(layout, events, chances=caps, eviction=eviction)
    return PerGroupPools(layout, events, chances=caps, eviction=eviction)
