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
from collections import OrderedDict
from collections.abc import Collection, Mapping, Sequence
from typing import Any, ClassVar

from hybridkv.cache.events import EventLog
from hybridkv.errors import InvariantError, PlanError
from hybridkv.plan.layout import NULL_BLOCK_ID, MemoryLayout, Strategy
from hybridkv.specs import WINDOW_KINDS

__all__ = [
    "DEFAULT_CHANCES",
    "DEFAULT_WINDOW_CHANCES",
    "MAX_CHANCES",
    "BlockPool",
    "FreeListPool",
    "chance_caps",
    "check_chances",
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
        """Arena only: the group holding ``chunk`` (None when free)."""
        raise InvariantError(f"chunk_owner: the {self.strategy} strategy has no chunks")

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` on any inconsistency of the pool's own structures."""

    @abstractmethod
    def snapshot(self) -> Any:
        """A deep, comparable copy of every structure (for atomicity tests)."""


class FreeListPool:
    """``num_blocks`` blocks shared by ``group_ids``; a block belongs to one group at a time.

    The building block of the ``uniform`` strategy (one instance for all groups) and the
    ``pools`` strategy (one instance per group).  ``owner[b]`` is the group whose table or
    prefix cache holds block ``b`` (-1 for an uncached free block).

    Eviction takes the least recently used cached free block; with ``second_chance`` = ``k``
    >= 1, each hit a block serves (a touch) gives it a chance, up to ``k`` held at once, and a
    block holding one when it reaches the evict-first end is moved to the most-recently-used
    end instead, one chance spent (CLOCK's second chance for ``k`` = 1, generalized CLOCK's
    hit counter above it).  A block every request shares, such as a system prompt's, then
    survives up to ``k`` allocations that each sweep the whole LRU.  Feasibility is unchanged
    (the count of evictable blocks is the same).  0 turns it off.
    :class:`~hybridkv.cache.pool_arena.ArenaPool` does the same per block and idle chunk.
    """

    __slots__ = (
        "chances",
        "events",
        "first",
        "free_cached",
        "free_uncached",
        "fresh",
        "group_ids",
        "group_used",
        "hashes",
        "hit",
        "maps",
        "num_blocks",
        "num_used",
        "owner",
        "refs",
    )

    def __init__(
        self,
        num_blocks: int,
        group_ids: Sequence[int],
        events: EventLog,
        *,
        first: int = 1,
        second_chance: int = DEFAULT_CHANCES,
    ) -> None:
        #: Ids ``[1, first)`` are reserved: never handed out (an arena's null chunk).
        self.first = first
        self.num_blocks = num_blocks
        self.group_ids = tuple(group_ids)
        self.events = events
        self.refs = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        self.owner = [-1] * num_blocks
        self.maps: dict[int, dict[int, int]] = {g: {} for g in self.group_ids}
        #: Uncached free blocks that were used before (LIFO: popitem() takes the last freed);
        #: ids from ``fresh`` up were never handed out and are taken in order after them, so a
        #: pool of millions of blocks costs nothing until it is used.
        self.free_uncached: dict[int, None] = {}
        self.fresh = first
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.num_used = 0
        #: Referenced blocks per owner group (their sum is ``num_used``).
        self.group_used: dict[int, int] = dict.fromkeys(self.group_ids, 0)
        #: ``hit[b]``: the chances block ``b`` holds (hits served, not yet spent; at most
        #: ``chances``); None when the second chance is off.
        self.chances = check_chances(second_chance)
        self.hit: bytearray | None = bytearray(num_blocks) if self.chances else None

    @property
    def num_free(self) -> int:
        return len(self.free_uncached) + len(self.free_cached) + self.num_blocks - self.fresh

    def allocate(self, group_id: int, n: int) -> list[int]:
        refs, owner = self.refs, self.owner
        fu = self.free_uncached
        out: list[int] = []
        take = min(n, len(fu))
        hit = self.hit
        for _ in range(take):
            b = fu.popitem()[0]
            refs[b] = 1
            owner[b] = group_id
            out.append(b)
            if hit is not None:
                hit[b] = 0
        if take < n and self.fresh < self.num_blocks:  # never used: no mark to clear
            start = self.fresh
            stop = min(self.num_blocks, start + n - take)
            for b in range(start, stop):
                refs[b] = 1
                owner[b] = group_id
            out.extend(range(start, stop))
            self.fresh = stop
            take += stop - start
        if take < n:
            self._allocate_evicting(group_id, n - take, out)
        self.num_used += n
        self.group_used[group_id] += n
        return out

    def _allocate_evicting(self, group_id: int, n: int, out: list[int]) -> None:
        fc, refs, owner, hashes, maps = (
            self.free_cached,
            self.refs,
            self.owner,
            self.hashes,
            self.maps,
        )
        if n > len(fc):
            raise InvariantError(f"FreeListPool.allocate: {n} blocks wanted, {len(fc)} evictable")
        # Who evicted what is only gathered for a listener (events, a lower tier's sink).
        evicted: list[tuple[int, int, int]] | None = [] if self.events.tracks_evictions else None
        hit = self.hit
        pop, append = fc.popitem, out.append
        for _ in range(n):
            b = pop(False)[0]
            if hit is not None:
                while hit[b]:  # each spends one: n <= len(fc) ends the loop
                    hit[b] -= 1
                    fc[b] = None
                    b = pop(False)[0]
            h = hashes[b]
            assert h is not None
            old = owner[b]
            del maps[old][h]
            hashes[b] = None
            if evicted is not None:
                evicted.append((old, h, b))
            refs[b] = 1
            owner[b] = group_id
            append(b)
        if evicted is not None:
            for old, h, b in evicted:
                self.events.evicted(old, (h,), (b,))  # type: ignore[arg-type]

    def touch(self, group_id: int, blocks: Sequence[int], most: int = -1) -> None:
        """Revive or reference ``blocks`` of ``group_id`` (hits); each gains a chance up to
        ``most`` (-1: the pool's ``chances``; a shared pool passes the touching group's)."""
        refs, fc, hit = self.refs, self.free_cached, self.hit
        if most < 0:
            most = self.chances
        revived = 0
        for b in blocks:
            r = refs[b]
            if not r:
                del fc[b]
                revived += 1
            refs[b] = r + 1
            if hit is not None and hit[b] < most:
                hit[b] += 1
        if revived:
            self.num_used += revived
            self.group_used[group_id] += revived

    def release(self, group_id: int, blocks: Sequence[int]) -> None:
        """Drop a reference of each of ``blocks`` of ``group_id``."""
        refs, hashes, owner = self.refs, self.hashes, self.owner
        fu, fc = self.free_uncached, self.free_cached
        freed = 0
        for b in blocks:
            r = refs[b] - 1
            refs[b] = r
            if r:
                continue
            freed += 1
            if hashes[b] is None:
                owner[b] = -1
                fu[b] = None
            else:
                fc[b] = None
        self.num_used -= freed
        self.group_used[group_id] -= freed

    def refresh(self, blocks: Sequence[int]) -> None:
        refs, fc = self.refs, self.free_cached
        for b in blocks:
            if not refs[b] and b in fc:
                fc.move_to_end(b)

    def uncache(self, blocks: Sequence[int]) -> int:
        """:meth:`BlockPool.uncache` (each block's owner group is its own)."""
        refs, hashes, owner, maps = self.refs, self.hashes, self.owner, self.maps
        fu, fc, hit = self.free_uncached, self.free_cached, self.hit
        dropped: list[tuple[int, int, int]] = []
        for b in blocks:
            h = hashes[b]
            if h is None or refs[b]:
                continue
            g = owner[b]
            del fc[b]
            del maps[g][h]
            hashes[b] = None
            owner[b] = -1
            fu[b] = None
            if hit is not None:
                hit[b] = 0
            dropped.append((g, h, b))
        if self.events.tracks_evictions:
            for g, h, b in dropped:
                self.events.evicted(g, (h,), (b,))  # type: ignore[arg-type]
        return len(dropped)

    def free_delta(self, releases: Sequence[int] | None, touches: Sequence[int] | None) -> int:
        """Change of the free count if ``releases`` then ``touches`` were applied."""
        refs = self.refs
        delta = 0
        if releases:
            for b in releases:
                if refs[b] == 1:
                    delta += 1
        if touches:
            for b in touches:
                if not refs[b]:
                    delta -= 1
        return delta

    def reset_cache(self) -> bool:
        if self.num_used:
            return False
        # In place: managers hold references to these lists and dicts.
        self.hashes[:] = [None] * self.num_blocks
        self.owner[:] = [-1] * self.num_blocks
        for m in self.maps.values():
            m.clear()
        self.free_uncached.clear()
        self.fresh = self.first
        self.free_cached.clear()
        if self.hit is not None:
            self.hit[:] = bytes(self.num_blocks)
        return True

    def check_invariants(self) -> None:
        refs, hashes, owner = self.refs, self.hashes, self.owner
        fu, fc = self.free_uncached, self.free_cached
        if refs[NULL_BLOCK_ID] or hashes[NULL_BLOCK_ID] is not None:
            raise InvariantError("null block has a reference count or a hash")
        if NULL_BLOCK_ID in fu or NULL_BLOCK_ID in fc:
            raise InvariantError("null block is in a free queue")
        for b in range(1, self.first):
            if refs[b] or hashes[b] is not None or b in fu or b in fc:
                raise InvariantError(f"reserved block {b} is referenced, cached or queued")
        hit = self.hit
        if hit is not None and (len(hit) != self.num_blocks or any(hit[: self.first])):
            raise InvariantError("second-chance marks on reserved blocks, or a wrong count")
        if hit is not None and max(hit) > self.chances:
            raise InvariantError(f"a block holds more than {self.chances} second chances")
        used = 0
        per_group = dict.fromkeys(self.group_ids, 0)
        fresh = self.fresh
        if not self.first <= fresh <= self.num_blocks:
            raise InvariantError(f"fresh {fresh} not in [{self.first}, {self.num_blocks}]")
        for b in range(self.first, self.num_blocks):
            r = refs[b]
            if r and b >= fresh:
                raise InvariantError(f"block {b} has {r} references but was never handed out")
            if r < 0:
                raise InvariantError(f"block {b} has ref count {r}")
            in_fu, in_fc = b in fu, b in fc
            if r:
                used += 1
                if in_fu or in_fc:
                    raise InvariantError(f"block {b} has {r} references but is in a free queue")
                if owner[b] not in self.maps:
                    raise InvariantError(f"referenced block {b} has owner {owner[b]}")
                per_group[owner[b]] += 1
            elif b >= fresh:
                if in_fu or in_fc or hashes[b] is not None or owner[b] != -1:
                    raise InvariantError(f"never-used block {b} is queued, cached or owned")
            elif in_fu == in_fc:
                raise InvariantError(f"free block {b} is in {int(in_fu) + int(in_fc)} free queues")
            elif in_fu and (hashes[b] is not None or owner[b] != -1):
                raise InvariantError(f"block {b} is in the uncached queue but holds a hash")
            elif in_fc and hashes[b] is None:
                raise InvariantError(f"block {b} is in the cached LRU but holds no hash")
            h = hashes[b]
            if h is not None and self.maps.get(owner[b], {}).get(h) != b:
                raise InvariantError(f"block {b} holds hash {h:#x} but group map disagrees")
        if used != self.num_used:
            raise InvariantError(f"num_used {self.num_used} != {used} referenced blocks")
        if per_group != self.group_used:
            raise InvariantError(f"group_used {self.group_used} != {per_group} referenced blocks")
        mapped = 0
        for g, m in self.maps.items():
            for h, b in m.items():
                if hashes[b] != h or owner[b] != g:
                    raise InvariantError(f"group {g} maps hash {h:#x} to block {b} that lacks it")
            mapped += len(m)
        if mapped != sum(1 for h in hashes if h is not None):
            raise InvariantError("cached blocks and hash-map entries differ in number")

    def snapshot(self) -> Any:
        return (
            list(self.refs),
            list(self.hashes),
            list(self.owner),
            {g: list(m.items()) for g, m in self.maps.items()},
            list(self.free_uncached),
            self.fresh,
            list(self.free_cached),
            self.num_used,
            dict(self.group_used),
            None if self.hit is None else bytes(self.hit),
        )
