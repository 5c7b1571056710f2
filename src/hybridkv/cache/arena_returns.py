"""The arena's frees: how blocks return to (and hits take them back from) the queues.

:class:`ArenaReturns` is the half of :class:`hybridkv.cache.pool_arena.ArenaPool` that moves
blocks between *referenced* and *free* without allocating (touch, release, refresh) and drops
cached entries in place (:meth:`ArenaReturns.uncache`); see that module for the chunk states
and the stamps.  Every operation is O(1) per block but a chunk going idle or being revived,
O(blocks per chunk).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from hybridkv.cache.arena_fits import ArenaFits
from hybridkv.cache.arena_packing import FillIndex
from hybridkv.cache.events import EventLog

__all__ = ["ArenaReturns"]


class ArenaReturns(ArenaFits):
    """Touch, release, refresh and uncache over an :class:`ArenaPool`'s structures (declared
    here and in :class:`ArenaFits`; single inheritance for the compiled build)."""

    maps: list[dict[int, int]]
    idle: list[OrderedDict[int, None]]
    owner: list[int]
    used: list[int]
    caps: list[int]
    #: A NoFill is a FillIndex (declaring the union segfaults mypyc 2.4 in the compiled build).
    fill: FillIndex
    events: EventLog

    def _activate(self, g: int, c: int, exclude: int) -> None:
        raise NotImplementedError

    def touch(self, group_id: int, blocks: Sequence[int]) -> None:
        g = group_id
        refs, fc = self.refs[g], self.free_cached[g]
        crefd, ccf = self.chunk_refd, self.chunk_cached_free
        bb, cb = self.block_bytes[g], self.chunk_bytes
        hitg, chance = self.hit[g], self.caps[g]
        fill = self.fill
        at = fill.at
        moved: dict[int, None] = {}  # chunks whose count changed: refiled once, at the end
        for b in blocks:
            if hitg[b] < chance:
                hitg[b] += 1
            r = refs[b]
            if not r:
                c = b * bb // cb
                if crefd[c]:
                    del fc[b]
                else:
                    del self.idle[g][c]
                    del self.idle_all[c]
                    self._activate(g, c, b)
                ccf[c] -= 1
                crefd[c] += 1
                if at[c] >= 0:
                    moved[c] = None
                self.used[g] += 1
            refs[b] = r + 1
        for c in moved:
            fill.moved(g, c)

    def release(self, group_id: int, blocks: Sequence[int]) -> None:
        g = group_id
        if self.bpc[g] == 1:
            self._release_whole_chunks(g, blocks)
            return
        refs, hashes, bpc = self.refs[g], self.hashes[g], self.bpc[g]
        fu, fc = self.free_uncached[g], self.free_cached[g]
        crefd, ccf = self.chunk_refd, self.chunk_cached_free
        bb, cb = self.block_bytes[g], self.chunk_bytes
        fill = self.fill
        at = fill.at
        moved: dict[int, None] = {}  # chunks whose count changed: refiled once, at the end
        for b in blocks:
            r = refs[b] - 1
            refs[b] = r
            if r:
                continue
            self.used[g] -= 1
            c = b * bb // cb
            left = crefd[c] - 1
            crefd[c] = left
            cached = hashes[b] is not None
            if left:
                if at[c] >= 0:
                    moved[c] = None
                if cached:
                    self.clock += 1
                    fc[b] = self.clock
                    ccf[c] += 1
                else:
                    fu[b] = None
                    fill.add(g, c, b)
                continue
            # No referenced block left: the chunk's other (free) blocks leave g's queues.
            fill.clear(g, c)
            f = self.first[g][c]
            for x in range(f, f + bpc):
                if x != b:
                    if hashes[x] is None:
                        del fu[x]
                    else:
                        del fc[x]
            if cached:
                ccf[c] += 1
            if ccf[c]:
                self.clock += 1
                self.idle[g][c] = None
                self.idle_all[c] = self.clock
            else:
                self.owner[c] = -1
                self.free_chunks.append(c)
        for c in moved:  # a no-op for a chunk that went idle (no longer filed)
            fill.moved(g, c)

    def _release_whole_chunks(self, g: int, blocks: Sequence[int]) -> None:
        """:meth:`release` for a group with one block per chunk: a block whose last reference
        goes makes its chunk idle (cached) or free at once."""
        refs, hashes = self.refs[g], self.hashes[g]
        crefd, ccf, owner = self.chunk_refd, self.chunk_cached_free, self.owner
        idle, idle_all, free = self.idle[g], self.idle_all, self.free_chunks
        bb, cb = self.block_bytes[g], self.chunk_bytes
        freed = 0
        for b in blocks:
            r = refs[b] - 1
            refs[b] = r
            if r:
                continue
            freed += 1
            c = b if bb == cb else b * bb // cb
            crefd[c] = 0
            if hashes[b] is None:
                owner[c] = -1
                free.append(c)
            else:
                ccf[c] = 1
                self.clock += 1
                idle[c] = None
                idle_all[c] = self.clock
        self.used[g] -= freed

    def refresh(self, group_id: int, blocks: Sequence[int]) -> None:
        g = group_id
        refs, fc = self.refs[g], self.free_cached[g]
        bb, cb = self.block_bytes[g], self.chunk_bytes
        for b in blocks:
            if refs[b]:
                continue
            c = b * bb // cb
            if self.chunk_refd[c]:
                if b in fc:
                    self.clock += 1
                    fc[b] = self.clock
                    fc.move_to_end(b)
            elif c in self.idle[g]:
                self.clock += 1
                self.idle[g].move_to_end(c)
                self.idle_all[c] = self.clock
                self.idle_all.move_to_end(c)

    def untouched(self, group_id: int, blocks: Sequence[int]) -> list[int]:
        if not self.caps[group_id]:
            return []
        hitg = self.hit[group_id]
        return [b for b in blocks if not hitg[b]]

    def uncache(self, group_id: int, blocks: Sequence[int]) -> int:
        g = group_id
        refs, hashes, m = self.refs[g], self.hashes[g], self.maps[g]
        fu, fc, hitg = self.free_uncached[g], self.free_cached[g], self.hit[g]
        crefd, ccf = self.chunk_refd, self.chunk_cached_free
        bb, cb = self.block_bytes[g], self.chunk_bytes
        dropped: list[int] = []
        where: list[int] = []
        for b in blocks:
            h = hashes[b]
            if h is None or refs[b]:
                continue
            del m[h]
            hashes[b] = None
            hitg[b] = 0
            dropped.append(h)
            where.append(b)
            c = b * bb // cb
            ccf[c] -= 1
            if crefd[c]:  # active: the block moves from g's LRU to its uncached queue
                del fc[b]
                fu[b] = None
                self.fill.add(g, c, b)
            elif not ccf[c]:  # idle and now holds nothing: the chunk is free for any group
                del self.idle[g][c]
                del self.idle_all[c]
                self.owner[c] = -1
                self.free_chunks.append(c)
        if dropped and self.events.tracks_evictions:
            self.events.evicted(g, tuple(dropped), where)  # type: ignore[arg-type]
        return len(dropped)
