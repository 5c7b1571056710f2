"""The block-pool contract every strategy implements, and the free-list pool it builds on.

A pool hands out block ids per group, keeps a reference count per block, and keeps each
group's prefix cache: a ``hash -> block`` map plus the hash each cached block holds.  Blocks
with no references are *free*; a free block that still holds a hash is *cached* and can be
revived by a hit (:meth:`BlockPool.touch`) until it is evicted to serve an allocation.

Free blocks wait in two queues: uncached ones in a LIFO (reused first, so recently freed
memory is recycled before cached data is evicted) and cached ones in an LRU (the least
recently freed is evicted first).  A request frees its blocks in reverse order, so its tail
enters the LRU first and is evicted before its prefix.  All queue operations are O(1)
(``dict`` / ``OrderedDict``).

Hot-path access: managers read ``refs[g]``, ``hashes[g]`` and ``maps[g]`` directly (the lists
and dicts group ``g`` indexes); only the pool mutates them.  The null block (id 0) is never
allocated, counted or queued.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

from hybridkv.cache.errors import LayoutMismatchError
from hybridkv.cache.events import EventLog
from hybridkv.errors import InvariantError, PlanError
from hybridkv.plan.layout import MemoryLayout, Strategy
from hybridkv.specs import WINDOW_KINDS

__all__ = [
    "DEFAULT_CHANCES",
    "DEFAULT_WINDOW_CHANCES",
    "EVICTION_ORDERS",
    "GHOST_PER_BLOCK",
    "MAX_CHANCES",
    "PROBATION_SHARE",
    "BlockPool",
    "chance_caps",
    "check_chances",
    "check_eviction_order",
    "group_chances",
]

#: Chances a block that served hits holds at most, by default (see :class:`FreeListPool`).
#: Measured with ``benchmarks/compare_vllm.py`` on the Mooncake trace (docs/vllm.md): 2 keeps
#: gemma-3-27b's system prompt through more of the prefill bursts that sweep the LRU (64 GiB:
#: 3.684% -> 3.702% of prompt tokens in the arena) but costs Nemotron-H-8B (64 GiB: 6.49% ->
#: 5.89%) and gpt-oss-20b (9.86% -> 9.51%), so the default stays at CLOCK's one; windowed
#: groups alone take 2 (:data:`DEFAULT_WINDOW_CHANCES`), which keeps gemma-3-27b's gain.
DEFAULT_CHANCES = 1
#: Chances a block of a windowed group (sliding window, local chunks) holds at most, by
#: default, when the second chance is on.  A window's blocks serve a hit only all together, and
#: a shared prefix's window (a system prompt's) is released by every request that passes it
#: while that request still runs, so it waits in the LRU far more often than the prefix's
#: full-attention blocks, which every running request holds.  Measured with
#: ``benchmarks/compare_vllm.py`` on the Mooncake trace (docs/vllm.md, section 6): gemma-3-27b
#: at 64 GiB 3.684% -> 3.702% of prompt tokens (arena), 3.696% -> 3.722% (``uniform``), the
#: whole gain of ``second_chance=2`` there, while gpt-oss-20b's sliding layers change nothing
#: (16 GiB 3.724%, 64 GiB 9.862% either way), where 2 for every group cost it 9.86% -> 9.51%.
DEFAULT_WINDOW_CHANCES = 2
#: The most a pool accepts (one byte per block).
MAX_CHANCES = 255

#: Eviction orders of the free-list pools: ``"lru"`` (one least-recently-used queue) or
#: ``"2q"`` (new cached blocks on probation; see :class:`FreeListPool`).
EVICTION_ORDERS = ("lru", "2q")
#: 2Q: the share of the evictable blocks past which probation evicts first.
PROBATION_SHARE = 0.1
#: 2Q: the evicted block hashes remembered, per block of the pool.
GHOST_PER_BLOCK = 5


def check_eviction_order(eviction: str) -> str:
    """``eviction``, or :class:`PlanError` naming it unless it is one of
    :data:`EVICTION_ORDERS`."""
    if eviction not in EVICTION_ORDERS:
        raise PlanError(
            f"eviction: {eviction!r} is not an eviction order; valid: {', '.join(EVICTION_ORDERS)}"
        )
    return eviction


def check_chances(value: object, field: str = "second_chance") -> int:
    """``value`` as a chance count (``True`` / ``False`` are 1 / 0); raises PlanError naming
    ``field`` unless it is an integer in ``[0, MAX_CHANCES]``."""
    if not isinstance(value, int) or not 0 <= value <= MAX_CHANCES:
        raise PlanError(
            f"{field}: {value!r} is not a chance count; valid: an integer in "
            f"[0, {MAX_CHANCES}] (0 off, 1 CLOCK's second chance, True / False = 1 / 0)"
        )
    return int(value)


def group_chances(
    layout: MemoryLayout, second_chance: int, window_chances: int | None = None
) -> list[int]:
    """The chances a block of each group of ``layout`` holds at most: ``second_chance`` for
    every group but the windowed ones (sliding window, local chunks), which take
    ``window_chances``, or when it is None ``max(second_chance, DEFAULT_WINDOW_CHANCES)``
    (0 when ``second_chance`` is 0).  Raises PlanError for a bad count."""
    k = check_chances(second_chance)
    if window_chances is None:
        w = max(k, DEFAULT_WINDOW_CHANCES) if k else 0
    else:
        w = check_chances(window_chances, "window_chances")
    return [w if g.spec.kind in WINDOW_KINDS else k for g in layout.groups]


def chance_caps(num_groups: int, second_chance: int, chances: Sequence[int] | None) -> list[int]:
    """A pool's per-group chance caps: ``chances`` checked (one per group), or
    ``second_chance`` for every group.  Raises PlanError for a bad count or length."""
    if chances is None:
        return [check_chances(second_chance)] * num_groups
    caps = [check_chances(c) for c in chances]
    if len(caps) != num_groups:
        raise PlanError(f"chances: {len(caps)} counts for {num_groups} groups")
    return caps


#: Per-group optional lists handed to :meth:`BlockPool.fits` (``None`` = nothing).
GroupLists = Sequence[Sequence[int] | None]


class BlockPool(ABC):
    """Blocks of every group of one layout.

    Mutating calls assume the caller checked feasibility with :meth:`fits`; they raise
    :class:`InvariantError` only on a bookkeeping bug.
    """

    strategy: ClassVar[Strategy]
    #: Whether :meth:`fits` reads its ``cached`` argument (callers may pass Nones otherwise).
    reads_cached_hint: ClassVar[bool] = False

    refs: list[list[int]]
    hashes: list[list[int | None]]
    maps: list[dict[int, int]]

    def __init__(self, layout: MemoryLayout, events: EventLog) -> None:
        if layout.strategy is not self.strategy:
            raise InvariantError(f"{type(self).__name__} built for a {layout.strategy} layout")
        self.layout = layout
        self.events = events
        self.num_groups = len(layout.groups)

    # -- mutation ---------------------------------------------------------------------------
    @abstractmethod
    def allocate(self, group_id: int, n: int) -> list[int]:
        """Take ``n`` free blocks for ``group_id`` (ref count 1 each), evicting if needed."""

    def blocks_per_chunk(self, group_id: int) -> int:
        """Blocks of ``group_id`` one chunk of the pool holds (1: the pool has no chunks)."""
        return 1

    def spreads(self, needs: Sequence[int], spreading: Mapping[int, int]) -> bool:
        """Whether ``needs[g]`` blocks for every group ``g`` come without evicting anything
        when ``spreading[g]`` of a group's blocks come from whole free chunks
        (:meth:`allocate_spread`, after the rest of its blocks) and every other block from
        its group's free blocks first: then :meth:`allocate` would evict nothing either.
        False for a pool without chunks."""
        return False

    def allocate_spread(self, group_id: int, n: int) -> list[int]:
        """:meth:`allocate`, but taking whole free chunks before the free blocks of chunks
        already in use (only when :meth:`spreads` said so for the call's needs); a pool
        without chunks allocates as usual."""
        return self.allocate(group_id, n)

    def chunks_short(self, needs: Sequence[int]) -> int:
        """Arena: the whole chunks ``needs[g]`` blocks per group lack (an upper bound); 0 for
        a pool without chunks."""
        return 0

    def compact(
        self, chunks: int, movable: Collection[int], fixed: Collection[int] = ()
    ) -> list[tuple[int, int, int]]:
        """Free up to ``chunks`` chunks (none of ``fixed``) by moving the referenced (and the
        youngest cached) blocks of the ``movable`` groups out of them; returns the moves
        ``(group, src, dst)`` in the order their bytes must be copied
        (:mod:`~hybridkv.cache.arena_compact`).  A pool without chunks moves nothing."""
        return []

    def chunk_of(self, group_id: int, block: int) -> int:
        """Arena only: the chunk holding ``block`` of ``group_id`` (the block itself in a pool
        without chunks)."""
        return block

    @abstractmethod
    def touch(self, group_id: int, blocks: Sequence[int]) -> None:
        """Add one reference to each (cached) block; a free one leaves the free queues."""

    @abstractmethod
    def release(self, group_id: int, blocks: Sequence[int]) -> None:
        """Drop one reference from each block, in order; at zero it joins the free queues."""

    @abstractmethod
    def refresh(self, group_id: int, blocks: Sequence[int]) -> None:
        """Move each unreferenced cached block to the most-recently-used end of eviction."""

    def cache(self, group_id: int, block: int, block_hash: int) -> None:
        """Publish a referenced, uncached block under ``block_hash`` (which must be unmapped)."""
        self.maps[group_id][block_hash] = block
        self.hashes[group_id][block] = block_hash

    def cache_many(self, group_id: int, items: Sequence[tuple[int, int, int]]) -> None:
        """:meth:`cache` for each ``(table index, block, hash)`` of ``items``, in order."""
        m, held = self.maps[group_id], self.hashes[group_id]
        for _, b, h in items:
            m[h] = b
            held[b] = h

    def untouched(self, group_id: int, blocks: Sequence[int]) -> list[int]:
        """The ``blocks`` of ``group_id`` that served no hit since they were allocated (they
        hold no chance: :meth:`touch` gives one); empty where the group keeps no chances, so
        it cannot tell."""
        return []

    @abstractmethod
    def uncache(self, group_id: int, blocks: Sequence[int]) -> int:
        """Drop the prefix-cache entries of the free cached ``blocks`` of ``group_id``: they
        become free uncached blocks, reported as evicted (events, the lower tiers' sink),
        reused before any cached block.  Referenced or uncached blocks are skipped.  Returns
        how many were dropped."""

    @abstractmethod
    def reset_cache(self) -> bool:
        """Drop every cached hash if no block is referenced; False (no change) otherwise."""

    # -- queries ----------------------------------------------------------------------------
    @abstractmethod
    def fits(
        self,
        cached: Sequence[set[int] | None],
        releases: GroupLists,
        touches: GroupLists,
        needs: Sequence[int],
    ) -> bool:
        """Whether one call can, in this order, release ``releases[g]`` (after caching the
        blocks in ``cached[g]``), touch ``touches[g]`` for every group, then allocate
        ``needs[g]`` blocks per group in group order.  Exact: True iff those calls succeed.
        Mutates nothing."""

    @abstractmethod
    def num_free(self, group_id: int) -> int:
        """Blocks ``group_id`` alone could allocate now (free, evictable, or in free chunks)."""

    @property
    @abstractmethod
    def usage(self) -> float:
        """Referenced bytes / allocatable bytes (the null block and chunk 0 excluded)."""

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes of the blocks some request references (the numerator of :attr:`usage`)."""

    def num_used(self, group_id: int) -> int:
        """Blocks of ``group_id`` with a reference."""
        refs = self.refs[group_id]
        return len(refs) - refs.count(0)

    def used_per_group(self) -> list[int]:
        """:meth:`num_used` of every group (a pool whose groups share blocks counts them in
        one pass)."""
        return [self.num_used(g) for g in range(self.num_groups)]

    def is_allocated(self, group_id: int, block_id: int) -> bool:
        """True iff ``block_id`` of ``group_id`` is referenced by some request."""
        refs = self.refs[group_id]
        return 0 < block_id < len(refs) and refs[block_id] > 0

    def chunk_owner(self, chunk: int) -> int | None:
        """Arena only: the group holding ``chunk`` (None when free).  Raises
        :class:`LayoutMismatchError` for a chunk the arena lacks, or a layout without chunks."""
        raise LayoutMismatchError(
            f"chunk_owner: the {self.strategy.value} strategy has no chunks; only arena layouts do"
        )

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` on any inconsistency of the pool's own structures."""

    @abstractmethod
    def snapshot(self) -> Any:
        """A deep, comparable copy of every structure (for atomicity tests)."""
