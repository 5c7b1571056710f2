"""The arena's exact ``fits``: a dry run of one call's releases, touches and allocations.

:class:`ArenaFits` is the query half of :class:`hybridkv.cache.pool_arena.ArenaPool` (see that
module for the chunk states and the eviction order it replays).  It mutates nothing.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from itertools import chain

from hybridkv.cache.pool_base import BlockPool, GroupLists

__all__ = ["ArenaFits"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _bounded(
    rest: list[tuple[int, int]], cac: list[int], idle: int, bpc: list[int], *, most: bool
) -> bool:
    """Whether every ``(group, blocks)`` of ``rest`` is served, in order, from its ``cac``
    cached blocks and the ``idle`` chunks when each takes the most (or fewest) chunks it can."""
    for g, n in rest:
        b = bpc[g]
        if n > cac[g] + idle * b:
            return False
        idle -= min(idle, _cdiv(n, b)) if most else _cdiv(max(0, n - cac[g]), b)
    return True


class ArenaFits(BlockPool):
    """:meth:`fits` over the structures an :class:`ArenaPool` keeps (declared here).  A base
    class of the pool rather than a mixin, so the chain stays single inheritance (what the
    optional compiled build, mypyc, supports)."""

    num_groups: int
    own_first: bool
    bpc: list[int]
    block_bytes: list[int]
    first: list[list[int]]
    chunk_bytes: int
    refs: list[list[int]]
    hashes: list[list[int | None]]
    free_uncached: list[dict[int, None]]
    free_cached: list[OrderedDict[int, int]]
    idle_all: OrderedDict[int, int]
    clock: int
    chunk_refd: list[int]
    chunk_cached_free: list[int]
    free_chunks: list[int]
    second_chance: int
    hit: list[bytearray]

    def chunk_hit(self, c: int) -> bool:
        raise NotImplementedError

    def chunk_chances(self, c: int) -> int:
        raise NotImplementedError

    def _fits_without_eviction(self, releases: GroupLists, needs: Sequence[int]) -> bool:
        """True when uncached free blocks and free chunks alone cover ``needs`` (allocate then
        evicts nothing).  Releases and touches only add to those, except a release that idles
        a chunk of several blocks (its uncached free blocks leave the queue): with such a
        release this O(groups) shortcut does not apply and says False."""
        bpc = self.bpc
        if any(releases[g] and bpc[g] > 1 for g in range(self.num_groups)):
            return False
        spare = len(self.free_chunks)
        for g, need in enumerate(needs):
            short = need - len(self.free_uncached[g])
            if short > 0:
                spare -= -(-short // bpc[g])
        return spare >= 0

    def fits(
        self,
        cached: Sequence[set[int] | None],
        releases: GroupLists,
        touches: GroupLists,
        needs: Sequence[int],
    ) -> bool:
        # Replays the three phases on counters plus, for the LRU walk, the changes to the
        # cached queues: ``added[g]`` (released into an active chunk: block -> new stamp),
        # ``gone[g]`` (left g's LRU: chunk idled or block touched), ``revived`` / ``new_idle``
        # (idle chunks left / joined).  A touch that revives an idle chunk adds its siblings
        # to ``added``.  Stamps continue from ``self.clock`` as the real calls hand them out.
        if self._fits_without_eviction(releases, needs):
            return True
        free_chunks = len(self.free_chunks)
        idle = len(self.idle_all)
        unc = [len(q) for q in self.free_uncached]
        cac = [len(q) for q in self.free_cached]
        crefd, ccf, cb = self.chunk_refd, self.chunk_cached_free, self.chunk_bytes
        sim: dict[int, list[int]] = {}  # chunk -> [referenced, cached free] as simulated
        clock = self.clock
        added: dict[int, dict[int, int]] = {}
        gone: dict[int, set[int]] = {}
        revived: set[int] = set()
        new_idle: dict[int, int] = {}
        for g in range(self.num_groups):
            rel = releases[g]
            if not rel:
                continue
            refs, hashes, bpc = self.refs[g], self.hashes[g], self.bpc[g]
            bb, first = self.block_bytes[g], self.first[g]
            to_cache = cached[g] or ()
            add_g = added.setdefault(g, {})
            for b in rel:
                if refs[b] != 1:
                    continue
                c = b * bb // cb
                st = sim.get(c)
                if st is None:
                    st = sim[c] = [crefd[c], ccf[c]]
                is_cached = hashes[b] is not None or b in to_cache
                st[0] -= 1
                if st[0]:
                    if is_cached:
                        cac[g] += 1
                        st[1] += 1
                        clock += 1
                        add_g[b] = clock
                    else:
                        unc[g] += 1
                    continue
                unc[g] -= bpc - 1 - st[1]
                cac[g] -= st[1]
                if st[1]:  # the chunk's cached free blocks leave g's LRU
                    gone_g = gone.setdefault(g, set())
                    for x in range(first[c], first[c] + bpc):
                        if x == b or (hashes[x] is None and x not in to_cache):
                            continue
                        if add_g.pop(x, None) is None:
                            gone_g.add(x)
                if is_cached:
                    st[1] += 1
                if st[1]:
                    idle += 1
                    clock += 1
                    new_idle[c] = clock
                else:
                    free_chunks += 1
        for g in range(self.num_groups):
            tch = touches[g]
            if not tch:
                continue
            refs, hashes, bpc = self.refs[g], self.hashes[g], self.bpc[g]
            bb, first = self.block_bytes[g], self.first[g]
            to_cache = cached[g] or ()
            for b in tch:
                if refs[b]:
                    continue
                c = b * bb // cb
                st = sim.get(c)
                if st is None:
                    st = sim[c] = [crefd[c], ccf[c]]
                if not st[0]:  # idle chunk revived: its other cached blocks get new stamps
                    idle -= 1
                    unc[g] += bpc - st[1]
                    cac[g] += st[1]
                    if new_idle.pop(c, None) is None:
                        revived.add(c)
                    add_g = added.setdefault(g, {})
                    for x in range(first[c] + bpc - 1, first[c] - 1, -1):
                        if x != b and (hashes[x] is not None or x in to_cache):
                            clock += 1
                            add_g[x] = clock
                elif b in added.get(g, ()):
                    del added[g][b]
                else:
                    gone.setdefault(g, set()).add(b)
                st[0] += 1
                st[1] -= 1
                cac[g] -= 1
        # Blocks each group still needs once its uncached blocks and the free chunks are used
        # (free chunks go in group order, whatever is evicted after).
        rest: list[tuple[int, int]] = []
        for g, n in enumerate(needs):
            if not n:
                continue
            n -= min(n, unc[g])
            if not n:
                continue
            bpc = self.bpc[g]
            k = min(free_chunks, _cdiv(n, bpc))
            free_chunks -= k
            n -= k * bpc
            if n > 0:
                rest.append((g, n))
        if not rest:
            return True
        if self.own_first:
            for g, n in rest:
                k = _cdiv(max(0, n - cac[g]), self.bpc[g])
                if k > idle:
                    return False
                idle -= k
            return True
        # A group evicts at least ``lo`` and at most ``hi`` idle chunks; fewer taken leaves
        # more for later groups.  Decide from those bounds when they agree, else walk.
        if _bounded(rest, cac, idle, self.bpc, most=True):
            return True
        if not _bounded(rest, cac, idle, self.bpc, most=False):
            return False
        idle_seq = _Seq(
            chain(
                ((c, s) for c, s in self.idle_all.items() if c not in revived),
                new_idle.items(),
            )
        )
        spared: dict[tuple[int, int], int] = {}  # (group, block) or (-1, chunk): chances spent
        clock_box = [clock]
        for g, n in rest[:-1]:
            k = self._walk(g, n, idle_seq, clock_box, spared, gone.get(g), added.get(g))
            if k < 0:
                return False
            idle -= k
        g, n = rest[-1]  # nobody after it: the order it evicts in does not matter
        return n <= cac[g] + idle * self.bpc[g]

    def _walk(
        self,
        g: int,
        n: int,
        idle_seq: _Seq,
        clock: list[int],
        spared: dict[tuple[int, int], int],
        gone: set[int] | None,
        added: dict[int, int] | None,
    ) -> int:
        """Idle chunks ``g`` takes to evict ``n`` blocks in LRU order (-1: it cannot): its own
        cached blocks (the kept LRU, then ``added``) against idle chunks (``idle_seq``, shared by
        the groups of one :meth:`fits`: a chunk one group takes is gone for the next).  With
        the second chance, a head (block or idle chunk) holding more chances than it spent in
        ``spared`` spends one and moves to the young end with the next stamp (``clock[0]``), as
        :meth:`ArenaPool.allocate` does: own head first, then the idle head, before each
        decision."""
        fc = self.free_cached[g]
        items: Iterator[tuple[int, int]] = iter(fc.items())
        if gone:
            items = ((b, s) for b, s in fc.items() if b not in gone)
        if added:
            items = chain(items, added.items())
        own = _Seq(items)
        bpc, hit, chance = self.bpc[g], self.hit[g], self.second_chance
        taken = 0
        while n > 0:
            if chance:
                while (a := own.head()) is not None and hit[a[0]] > spared.get((g, a[0]), 0):
                    own.pop()
                    spared[g, a[0]] = spared.get((g, a[0]), 0) + 1
                    clock[0] += 1
                    own.push(a[0], clock[0])
                while (h := idle_seq.head()) is not None and self.chunk_chances(h[0]) > (
                    spent := spared.get((-1, h[0]), 0)
                ):
                    idle_seq.pop()
                    spared[-1, h[0]] = spent + 1
                    clock[0] += 1
                    idle_seq.push(h[0], clock[0])
            a = own.head()
            h = idle_seq.head()
            if a is not None and (h is None or a[1] < h[1]):
                n -= 1
                own.pop()
            elif h is not None:
                n -= bpc
                idle_seq.pop()
                taken += 1
            else:
                return -1
        return taken


class _Seq:
    """``(key, stamp)`` pairs in stamp order, read head first: those of ``items``, then the
    ones pushed back with new (always the newest) stamps."""

    __slots__ = ("_back", "_head", "_items")

    def __init__(self, items: Iterator[tuple[int, int]]) -> None:
        self._items = items
        self._back: deque[tuple[int, int]] = deque()
        self._head: tuple[int, int] | None = None

    def head(self) -> tuple[int, int] | None:
        if self._head is None:
            self._head = next(self._items, None)
            if self._head is None and self._back:
                self._head = self._back.popleft()
        return self._head

    def pop(self) -> None:
        self._head = None

    def push(self, key: int, stamp: int) -> None:
        self._back.append((key, stamp))
