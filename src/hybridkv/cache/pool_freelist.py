"""The free-list block pool: the core of the ``uniform`` and ``pools`` strategies and of the
arenas that need no chunk bookkeeping (:class:`~hybridkv.cache.pool_shared.FlatArenaPool`).

Its eviction orders are least recently used (with CLOCK-style chances for blocks that served
hits) and 2Q (blocks used once wait on a short probation; see :class:`FreeListPool`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from hybridkv.cache.events import EventLog
from hybridkv.cache.pool_base import (
    DEFAULT_CHANCES,
    GHOST_PER_BLOCK,
    PROBATION_SHARE,
    check_chances,
    check_eviction_order,
)
from hybridkv.errors import InvariantError
from hybridkv.plan.layout import NULL_BLOCK_ID

__all__ = ["FreeListPool"]


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

    ``eviction="2q"`` splits the cached free blocks in two, as the 2Q policy does: a block
    released for the first time waits on *probation* (``probation``, FIFO), and only a block
    that served a hit, or whose hash was evicted not long ago (it is in ``ghost``, the last
    ``GHOST_PER_BLOCK * num_blocks`` evicted hashes: the data came back), joins the main LRU
    (``free_cached``).  The groups of one prefix share its hashes, so a prefix one group
    lost proves the blocks of every group holding it (a hit needs them all: the state
    checkpoint with the attention blocks), and a returned hash stays in the ghost list until
    it ages out, for the other groups' blocks.  Eviction takes probation's oldest while probation
    holds more than ``PROBATION_SHARE`` of the evictable blocks, else the main LRU's least
    recently used (with its chances).  Data used once then leaves after a short stay instead
    of pushing out data that is reused, which in a cache smaller than the reuse distance
    (a conversation's next turn comes hundreds of requests later) keeps a stable set that
    hits rather than a queue that never does.  Feasibility is unchanged: both queues are
    evictable.
    """

    __slots__ = (
        "chances",
        "events",
        "first",
        "free_cached",
        "free_uncached",
        "fresh",
        "ghost",
        "ghost_cap",
        "group_ids",
        "group_used",
        "hashes",
        "hit",
        "maps",
        "num_blocks",
        "num_used",
        "owner",
        "probation",
        "proven",
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
        eviction: str = "lru",
    ) -> None:
        check_eviction_order(eviction)
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
        #: 2Q (None under LRU): cached free blocks on probation (FIFO), recently evicted block
        #: hashes of any group (oldest first, at most ``ghost_cap``), and ``proven[b]``:
        #: block ``b`` served a hit or its key came back from the ghost list.
        two_q = eviction == "2q"
        self.probation: OrderedDict[int, None] | None = OrderedDict() if two_q else None
        self.ghost: OrderedDict[int, None] | None = OrderedDict() if two_q else None
        self.ghost_cap = GHOST_PER_BLOCK * num_blocks
        self.proven: bytearray | None = bytearray(num_blocks) if two_q else None

    @property
    def num_free(self) -> int:
        free = len(self.free_uncached) + len(self.free_cached) + self.num_blocks - self.fresh
        return free if self.probation is None else free + len(self.probation)

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
            if self.probation is None:
                self._allocate_evicting(group_id, n - take, out)
            else:
                self._allocate_evicting_2q(group_id, n - take, out)
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
            self._report(evicted)

    def _allocate_evicting_2q(self, group_id: int, n: int, out: list[int]) -> None:
        """:meth:`_allocate_evicting` under 2Q: probation's oldest while probation holds more
        than its share of the evictable blocks, else the main LRU's (with its chances); each
        evicted key joins the ghost list at its young end (a key already there moves to it),
        which keeps the ``ghost_cap`` youngest."""
        fc, prob, ghost, proven = self.free_cached, self.probation, self.ghost, self.proven
        assert prob is not None and ghost is not None and proven is not None
        refs, owner, hashes, maps = self.refs, self.owner, self.hashes, self.maps
        if n > len(fc) + len(prob):
            raise InvariantError(
                f"FreeListPool.allocate: {n} blocks wanted, {len(fc) + len(prob)} evictable"
            )
        evicted: list[tuple[int, int, int]] | None = [] if self.events.tracks_evictions else None
        hit, share = self.hit, PROBATION_SHARE
        n_prob, n_main = len(prob), len(fc)
        pop_prob, pop_main, append = prob.popitem, fc.popitem, out.append
        again = ghost.move_to_end
        for _ in range(n):
            if n_prob and (not n_main or n_prob > share * (n_prob + n_main)):
                b = pop_prob(False)[0]
                n_prob -= 1
            else:
                b = pop_main(False)[0]
                n_main -= 1
                if hit is not None:
                    while hit[b]:  # each spends one; b goes back, so fc is never empty here
                        hit[b] -= 1
                        fc[b] = None
                        b = pop_main(False)[0]
            h = hashes[b]
            assert h is not None
            old = owner[b]
            del maps[old][h]
            hashes[b] = None
            proven[b] = 0
            if h in ghost:  # another group's block of the hash, or evicted again: young again
                again(h)
            else:
                ghost[h] = None
            if evicted is not None:
                evicted.append((old, h, b))
            refs[b] = 1
            owner[b] = group_id
            append(b)
        for _ in range(len(ghost) - self.ghost_cap):  # the oldest keys beyond the cap
            ghost.popitem(False)
        if evicted is not None:
            self._report(evicted)

    def _report(self, evicted: list[tuple[int, int, int]]) -> None:
        """A removal event for each ``(group, hash, block)`` an allocation evicted."""
        for old, h, b in evicted:
            self.events.evicted(old, (h,), (b,))  # type: ignore[arg-type]

    def _unqueue(self, b: int) -> None:
        """Take cached free block ``b`` out of whichever queue holds it."""
        fc = self.free_cached
        if b in fc:
            del fc[b]
        else:
            assert self.probation is not None
            del self.probation[b]

    def touch(self, group_id: int, blocks: Sequence[int], most: int = -1) -> None:
        """Revive or reference ``blocks`` of ``group_id`` (hits); each gains a chance up to
        ``most`` (-1: the pool's ``chances``; a shared pool passes the touching group's)."""
        refs, fc, hit = self.refs, self.free_cached, self.hit
        if most < 0:
            most = self.chances
        revived = 0
        proven = self.proven
        for b in blocks:
            r = refs[b]
            if not r:
                if proven is None:
                    del fc[b]
                else:
                    self._unqueue(b)
                revived += 1
            refs[b] = r + 1
            if proven is not None:
                proven[b] = 1  # a hit: main LRU when it is released again
            if hit is not None and hit[b] < most:
                hit[b] += 1
        if revived:
            self.num_used += revived
            self.group_used[group_id] += revived

    def release(self, group_id: int, blocks: Sequence[int]) -> None:
        """Drop a reference of each of ``blocks`` of ``group_id``."""
        if self.probation is not None:
            freed = self._release_2q(blocks)
            self.num_used -= freed
            self.group_used[group_id] -= freed
            return
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

    def _release_2q(self, blocks: Sequence[int]) -> int:
        """:meth:`release`'s references under 2Q: a cached block freed goes to the main LRU
        when proven (a hit, or its key back from the ghost list), else to probation.
        Returns how many blocks it freed."""
        refs, hashes, owner = self.refs, self.hashes, self.owner
        fu, fc, prob, ghost, proven = (
            self.free_uncached,
            self.free_cached,
            self.probation,
            self.ghost,
            self.proven,
        )
        assert prob is not None and ghost is not None and proven is not None
        freed = 0
        for b in blocks:
            r = refs[b] - 1
            refs[b] = r
            if r:
                continue
            freed += 1
            h = hashes[b]
            if h is None:
                owner[b] = -1
                proven[b] = 0
                fu[b] = None
                continue
            if proven[b] or h in ghost:  # a hit, or evicted before and needed again
                proven[b] = 1
                fc[b] = None
            else:
                prob[b] = None
        return freed

    def refresh(self, blocks: Sequence[int]) -> None:
        refs, fc, prob = self.refs, self.free_cached, self.probation
        for b in blocks:
            if not refs[b]:
                if b in fc:
                    fc.move_to_end(b)
                elif prob is not None and b in prob:
                    prob.move_to_end(b)

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
            if self.proven is None:
                del fc[b]
            else:
                self._unqueue(b)
                self.proven[b] = 0
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
        if self.probation is not None:
            assert self.ghost is not None and self.proven is not None
            self.probation.clear()
            self.ghost.clear()
            self.proven[:] = bytes(self.num_blocks)
        return True

    def check_invariants(self) -> None:
        refs, hashes, owner = self.refs, self.hashes, self.owner
        fu, fc = self.free_uncached, self.free_cached
        self._check_2q()
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
            in_fu, in_fc = b in fu, b in fc or (self.probation is not None and b in self.probation)
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

    def _check_2q(self) -> None:
        """2Q's queues and marks agree: probation and the main LRU are disjoint, probation
        holds unproven blocks and the main LRU proven ones, only referenced or cached blocks
        are proven, and the ghost list is within its bound."""
        prob, ghost, proven = self.probation, self.ghost, self.proven
        if prob is None:
            if ghost is not None or proven is not None:
                raise InvariantError("2Q ghost list or marks without its probation queue")
            return
        if ghost is None or proven is None or len(proven) != self.num_blocks:
            raise InvariantError("2Q probation without its ghost list or marks")
        fc, refs, hashes = self.free_cached, self.refs, self.hashes
        for b in prob:
            if b in fc or proven[b]:
                raise InvariantError(f"block {b} on probation is in the main LRU or proven")
        for b in fc:
            if not proven[b]:
                raise InvariantError(f"block {b} in the main LRU is not proven")
        for b in range(self.num_blocks):
            if proven[b] and not refs[b] and hashes[b] is None:
                raise InvariantError(f"free uncached block {b} is marked proven")
        if len(ghost) > self.ghost_cap:
            raise InvariantError(f"ghost list holds {len(ghost)} keys, above {self.ghost_cap}")

    def snapshot(self) -> Any:
        return (
            None if self.probation is None else list(self.probation),
            None if self.ghost is None else list(self.ghost),
            None if self.proven is None else bytes(self.proven),
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
