"""Compaction for the ``arena`` pool: free whole chunks by moving referenced blocks together.

A chunk of the arena changes hands only once none of its blocks is referenced.  A group with
several blocks per chunk (gemma-3-27b's sliding-window layers: five 6.5 MiB blocks to a
32.5 MiB chunk) ends up with referenced blocks spread thinly over many chunks, and the free
or cached slots around them serve that group alone: at a peak of running memory the other
group finds no chunk and the scheduler preempts, with gigabytes free in slots it cannot use.

:meth:`ArenaCompact.compact` frees up to ``chunks`` chunks.  Per group (of the ``movable``
ones), a chunk can be emptied while the group's unreferenced slots in its *other* chunks hold
the chunk's referenced blocks: each emptied chunk consumes exactly one chunk's worth
(``bpc``) of the group's unreferenced slots.  The chunks with the fewest referenced blocks go
first (least bytes to copy), over every group.  Then, per group:

1. the group keeps its youngest cached blocks that still fit in the slots left; the others
   are evicted, oldest first, as its LRU would (a block holding chances spends one and is
   kept as the youngest instead);
2. each referenced block of an emptied chunk moves to a free slot of another chunk, and so
   does each cached one kept (with its stamp and chances);
3. the emptied chunk joins the free stack.

The result lists every move ``(group, src, dst)`` in order: the caller copies the bytes of
block ``src`` to block ``dst`` before anything writes either, and re-reads the block tables
(a move rewrites every table that held ``src``; the coordinator does that).  Compaction
costs O(chunks of the movable groups + cached blocks of a compacted group) and a device copy
per moved block, so the scheduler calls it only where it would otherwise preempt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from hybridkv.cache.arena_returns import ArenaReturns

__all__ = ["ArenaCompact"]


class ArenaCompact(ArenaReturns):
    """:meth:`compact` over an :class:`~hybridkv.cache.pool_arena.ArenaPool`'s structures."""

    whole_chunks: int
    packs: bool
    clock: int

    def chunk_of(self, group_id: int, block: int) -> int:
        """The chunk holding ``block`` of ``group_id``."""
        return block * self.block_bytes[group_id] // self.chunk_bytes

    def _compactable(
        self, movable: Collection[int], fixed: Collection[int]
    ) -> list[tuple[int, int, int]]:
        """``(referenced blocks, chunk, group)`` of every chunk compaction could empty (not in
        ``fixed``), the cheapest first, at most ``unreferenced slots // bpc`` per group."""
        owner, crefd, bpc = self.owner, self.chunk_refd, self.bpc
        per: dict[int, list[tuple[int, int, int]]] = {}
        # Chunk 0 and the tail pseudo-chunk are lent for good (a phantom reference).
        for c in range(1, self.whole_chunks):
            g = owner[c]
            if g >= 0 and crefd[c] and g in movable and bpc[g] > 1 and c not in fixed:
                per.setdefault(g, []).append((crefd[c], c, g))
        out: list[tuple[int, int, int]] = []
        for g, items in per.items():
            most = (len(self.free_uncached[g]) + len(self.free_cached[g])) // bpc[g]
            items.sort()
            out.extend(items[:most])  # most < len(items): the referenced blocks need room
        out.sort()
        return out

    def chunks_short(self, needs: Sequence[int]) -> int:
        """Whole chunks ``needs[g]`` blocks per group lack beyond each group's free and cached
        blocks, the free chunks and the idle ones (an upper bound: the call's own releases
        are not counted)."""
        want = 0
        for g, n in enumerate(needs):
            extra = n - len(self.free_uncached[g]) - len(self.free_cached[g])
            if extra > 0:
                want += -(-extra // self.bpc[g])
        return want - len(self.free_chunks) - len(self.idle_all)

    def compact(
        self, chunks: int, movable: Collection[int], fixed: Collection[int] = ()
    ) -> list[tuple[int, int, int]]:
        victims = self._compactable(movable, fixed)[: max(0, chunks)]
        by_group: dict[int, list[int]] = {}
        for _, c, g in victims:
            by_group.setdefault(g, []).append(c)
        moves: list[tuple[int, int, int]] = []
        for g, chunks_g in by_group.items():
            self._empty(g, chunks_g, moves)
        return moves

    def _clock_victims(self, g: int, n: int) -> list[int]:
        """``n`` of group ``g``'s cached blocks to evict, oldest first, as its LRU evicts: a
        block holding chances (hits served) spends one and goes to the young end instead."""
        fc, hitg = self.free_cached[g], self.hit[g]
        order, again, out = list(fc), list[int](), list[int]()
        i = 0
        while len(out) < n:
            if i == len(order):  # every block left spent a chance: walk them again
                order, again, i = again, [], 0
            b = order[i]
            i += 1
            if hitg[b]:
                hitg[b] -= 1
                self.clock += 1
                fc[b] = self.clock
                fc.move_to_end(b)
                again.append(b)
            else:
                out.append(b)
        return out

    def _empty(self, g: int, victims: list[int], moves: list[tuple[int, int, int]]) -> None:
        """Move group ``g``'s blocks out of ``victims`` (see the module) and free them."""
        bpc, bb, cb = self.bpc[g], self.block_bytes[g], self.chunk_bytes
        refs, hashes, m, hitg = self.refs[g], self.hashes[g], self.maps[g], self.hit[g]
        fu, fc = self.free_uncached[g], self.free_cached[g]
        crefd, ccf, fill, first = self.chunk_refd, self.chunk_cached_free, self.fill, self.first[g]
        # 1. Keep the youngest cached blocks that fit in what the other chunks keep free: each
        # emptied chunk uses up one chunk's worth of the group's unreferenced slots.
        room = len(fu) + len(fc) - len(victims) * bpc
        if len(fc) > room:
            self.uncache(g, self._clock_victims(g, len(fc) - room))  # reported
        for c in victims:  # their free slots are no destination
            fill.clear(g, c)
            f = first[c]
            for x in range(f, f + bpc):
                fu.pop(x, None)
        # 2. Move what the victims still hold: referenced blocks, then the kept cached ones.
        kept: list[tuple[int, int]] = []  # (stamp, dst) of moved cached blocks
        for c in victims:
            f = first[c]
            for x in range(f, f + bpc):
                r = refs[x]
                h = hashes[x]
                if not r and h is None:
                    continue
                if self.packs:
                    d = fill.take(g)
                    del fu[d]
                else:
                    d = fu.popitem()[0]
                cd = d * bb // cb
                refs[d], hashes[d], hitg[d] = r, h, hitg[x]
                refs[x], hashes[x], hitg[x] = 0, None, 0
                if h is not None:
                    m[h] = d
                if r:
                    crefd[cd] += 1
                else:
                    kept.append((fc.pop(x), d))
                    ccf[cd] += 1
                if fill.at[cd] >= 0 and fill.at[cd] != crefd[cd]:
                    fill.moved(g, cd)
                moves.append((g, x, d))
            crefd[c] = ccf[c] = 0
            self.owner[c] = -1
            self.free_chunks.append(c)
        if kept:  # the LRU stays in stamp order
            merged = sorted([*((s, b) for b, s in fc.items()), *kept])
            fc.clear()
            fc.update(OrderedDict((b, s) for s, b in merged))
