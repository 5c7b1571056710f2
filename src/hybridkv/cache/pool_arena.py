"""The ``arena`` strategy: one region of chunks, carved into blocks by the group holding each.

Chunk ``c`` lends group ``g`` the ``bpc(g)`` block ids starting at ``first(g, c)``, and block
``b`` lies in chunk ``b * block_bytes(g) // chunk_bytes`` (``MemoryLayout.blocks_per_chunk``,
``chunk_first_block`` and ``chunk_of_block``; ``[c * bpc, (c + 1) * bpc)`` when the block
divides the chunk).  Chunk 0 holds the null blocks: it is lent for good to the layout's null
host (``MemoryLayout.null_host``; a phantom reference keeps it active, so it never goes idle,
free or to another group), or reserved when there is none.  The bytes past the last whole
chunk, when the layout lends them (``MemoryLayout.tail_host``), are a pseudo-chunk
``arena.num_chunks`` held the same way by the tail host.  A chunk is in one of three states:

* **free**: held by nobody, on the arena's free-chunk stack;
* **active**: held by group ``g`` with at least one referenced block; its free blocks wait in
  ``g``'s queues (uncached LIFO, cached LRU);
* **idle**: held by ``g``, no referenced block, at least one cached block; its blocks are in no
  queue (hits can still revive them), the chunk waits in ``g``'s idle LRU and the global one.

A chunk whose blocks are all free and uncached returns to the free stack at once, so memory
flows to whichever group needs it.

Eviction order (``chunk_lru``, the default) approximates one global LRU.  A global counter
hands out *stamps*: a cached block released into an active chunk, or refreshed there, gets
the next stamp; a chunk that goes idle, or whose block is refreshed while idle, gets the next
stamp as a whole; when a hit revives an idle chunk, its other cached blocks rejoin ``g``'s LRU
with new stamps (the chunk was just used); the cached blocks a reopened chunk (step 3) did not
evict rejoin it with stamp 0, at the evict-first end.  ``g``'s cached LRU and the global idle
LRU are kept in stamp order (non-decreasing / increasing).  Group ``g`` takes a block from, in
order:

1. an uncached free block: where a group needs whole chunks (one block per chunk) next to
   groups with several, of its active chunk with the most referenced blocks (ties: the chunk
   with free blocks longest; :mod:`~hybridkv.cache.arena_packing`), so referenced blocks pack
   and sparse chunks drain for that group; in other layouts, the block freed last;
2. a free chunk (carved for ``g``);
3. whichever is older: its least recently used cached block in an active chunk, or the
   least-recently idled chunk of *any* group.  Its own idle chunk is reopened (its cached
   blocks evicted lowest first before anything else); another group's is emptied (cached
   blocks evicted) and carved.

With ``second_chance`` = ``k`` >= 1 (the default 1; :class:`~hybridkv.cache.pool_freelist.
FreeListPool`), each hit a block serves (a touch) gives it a chance, up to ``k``; before step
3 compares, a head of g's LRU holding a chance spends one and gets a new stamp, then so does
a head of the idle LRU (an idle chunk holding a block with a chance: every such block of the
chunk spends one): spared, as CLOCK does (once each for ``k`` = 1).

Stamps are unique, so "older" is a strict order.  Every group loses the oldest cached data it
can reach: a whole idle chunk of any group, or one of its own blocks, but never another
group's block in an active chunk (a chunk with a referenced block cannot change hands).  With
one block per chunk every cached free block is an idle chunk and this is exactly the
``uniform`` strategy's global LRU.  The ``own_first`` policy instead evicts per group:
after step 2 a group evicts its own cached blocks in active chunks, then reopens its own idle
chunks, and only then empties another group's least-recently idled chunk.

Placement: :meth:`ArenaPool.allocate_spread` takes whole free chunks before step 1's free
blocks of active chunks.  The coordinator uses it for the blocks of a windowed group (sliding
window, local chunks; several blocks per chunk) that leave the window when the step ends, a
whole number of chunks of them (:mod:`~hybridkv.cache.window_spread`), and only when
:meth:`ArenaPool.spreads` says whole free chunks cover them and what the call's other blocks
do not find free, so neither order evicts anything and ``fits`` does not depend on it.
Released at the request's next call, they free whole chunks for any group, where in the free
slots of chunks holding other requests' windows they would stay stranded.

:meth:`ArenaPool.fits` stays exact: it replays the call's releases and touches on counters and
on the stamps they would hand out, then walks each group's LRU against the shared idle LRU in
the same order :meth:`ArenaPool.allocate` evicts (O(blocks evicted) per call).  Chunk
transitions (carve, reopen, idle, reclaim) cost O(blocks per chunk); every other operation is
O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from hybridkv.cache.arena_compact import ArenaCompact
from hybridkv.cache.arena_invariants import check_arena
from hybridkv.cache.arena_packing import FillIndex, NoFill
from hybridkv.cache.errors import LayoutMismatchError
from hybridkv.cache.events import EventLog
from hybridkv.cache.pool_base import DEFAULT_CHANCES, chance_caps
from hybridkv.errors import InvariantError, PlanError
from hybridkv.plan.layout import MemoryLayout, Strategy

__all__ = ["ARENA_EVICTION_POLICIES", "ArenaPool"]

#: ``chunk_lru`` (default): steps 1, 2, 3 below (one LRU over cached blocks and idle chunks).
#: ``own_first``: a group evicts its own cached blocks (active chunks, then its idle chunks)
#: before emptying another group's chunk.
ARENA_EVICTION_POLICIES = ("chunk_lru", "own_first")
#: ``bytes.translate`` table spending one chance of every block that holds one.
_SPEND = bytes([0, *range(255)])


class ArenaPool(ArenaCompact):
    """Chunks shared by every group of an ``arena`` layout."""

    strategy: ClassVar[Strategy] = Strategy.ARENA
    reads_cached_hint: ClassVar[bool] = True

    def __init__(
        self,
        layout: MemoryLayout,
        events: EventLog,
        *,
        eviction: str = "chunk_lru",
        second_chance: int = DEFAULT_CHANCES,
        chances: Sequence[int] | None = None,
    ) -> None:
        super().__init__(layout, events)
        if eviction not in ARENA_EVICTION_POLICIES:
            raise PlanError(
                f"arena eviction: unknown policy {eviction!r}; valid: "
                f"{', '.join(ARENA_EVICTION_POLICIES)}"
            )
        self.own_first = eviction == "own_first"
        arena = layout.arena
        if arena is None:
            raise InvariantError("arena layout without an ArenaPlan")
        self.null_host = layout.null_host
        self.tail_host = layout.tail_host
        whole = arena.num_chunks
        nc = whole + (self.tail_host is not None)  # the tail host's pseudo-chunk last
        groups = range(self.num_groups)
        self.num_chunks = nc
        self.whole_chunks = whole
        self.chunk_bytes = arena.chunk_bytes
        self.bpc = [layout.blocks_per_chunk(g) for g in groups]
        self.block_bytes = [layout.groups[g].block_bytes for g in groups]
        #: ``first[g][c]``: the first block id chunk ``c`` lends group ``g``.
        self.first = [[layout.chunk_first_block(g, c) for c in range(nc)] for g in groups]
        self.refs = [[0] * layout.num_block_ids(g) for g in groups]
        #: Second chance: ``hit[g][b]`` counts the chances block ``b`` holds (one per hit it
        #: served, at most ``second_chance``); a cached block (or an idle chunk holding one)
        #: with a chance is spared when it comes up for eviction: it spends one (every block
        #: of the chunk with one) and gets a new stamp (the young end).  ``caps[g]``: group
        #: ``g``'s most (``chances``, or ``second_chance`` for every group).
        self.caps = chance_caps(self.num_groups, second_chance, chances)
        self.second_chance = max(self.caps, default=0)
        self.hit = [bytearray(layout.num_block_ids(g)) for g in groups]
        self.hashes = [[None] * layout.num_block_ids(g) for g in groups]
        self.maps = [{} for _ in groups]
        self.free_uncached: list[dict[int, None]] = [{} for _ in groups]
        # Cached free blocks of active chunks -> last-use stamp, in non-decreasing stamp order.
        self.free_cached: list[OrderedDict[int, int]] = [OrderedDict() for _ in groups]
        self.idle: list[OrderedDict[int, None]] = [OrderedDict() for _ in groups]
        # Idle chunks of every group -> stamp (when idled or last refreshed), increasing.
        self.idle_all: OrderedDict[int, int] = OrderedDict()
        self.clock = 0  # last stamp handed out; stamps of real uses are >= 1
        self.owner = [-1] * nc
        self.chunk_refd = [0] * nc  # referenced blocks per chunk
        self.chunk_cached_free = [0] * nc  # free blocks holding a hash, per chunk
        self.free_chunks = list(range(whole - 1, 0, -1))  # pop() gives the lowest first
        self.used = [0] * self.num_groups
        #: Free uncached blocks by chunk, chunks by referenced blocks: where ``allocate``
        #: takes a group's next uncached block (the fullest active chunk, see
        #: :mod:`~hybridkv.cache.arena_packing`), in layouts where a group needs whole chunks
        #: (one block per chunk) next to groups with several; otherwise the block freed last.
        self.packs = 1 in self.bpc and max(self.bpc) > 1
        self.fill = (
            FillIndex(nc, self.bpc, self.chunk_refd)
            if self.packs
            else NoFill(nc, (), self.chunk_refd)  # no buckets: it files nothing
        )
        self._pin_loans()
        self._usable_bytes = (
            (whole - 1) * self.chunk_bytes
            + layout.null_chunk_usable_bytes
            + layout.tail_usable_bytes
        )

    def _pin_loans(self) -> None:
        """Lend chunk 0's ids past the null region to the null host, and the tail's ids to the
        tail host, for good."""
        for c, host in ((0, self.null_host), (self.whole_chunks, self.tail_host)):
            if host is None:
                continue
            g = host.group_id
            self.owner[c] = g
            self.chunk_refd[c] = 1  # the phantom reference: never idle, free or reclaimed
            ids = range(host.end - 1, host.first - 1, -1)
            self.free_uncached[g].update(dict.fromkeys(ids))
            self.fill.add_range(g, c, ids)

    # -- second chance ------------------------------------------------------------------------
    def chunk_hit(self, c: int) -> bool:
        """Whether idle chunk ``c`` holds a block with a chance left."""
        h = self.owner[c]
        f = self.first[h][c]
        return any(self.hit[h][f : f + self.bpc[h]])

    def chunk_chances(self, c: int) -> int:
        """The times idle chunk ``c`` can still be spared: its blocks' most chances."""
        h = self.owner[c]
        f = self.first[h][c]
        return max(self.hit[h][f : f + self.bpc[h]])

    def _spare_own(self, g: int) -> None:
        """Give ``g``'s marked LRU heads their second chance: mark cleared, a new stamp."""
        fc, hit = self.free_cached[g], self.hit[g]
        while fc:
            b = next(iter(fc))
            if not hit[b]:
                return
            hit[b] -= 1
            self.clock += 1
            fc[b] = self.clock
            fc.move_to_end(b)

    def _spare_idle(self, queue: OrderedDict[int, Any]) -> None:
        """The same for the idle chunks at the head of ``queue`` (the global idle LRU, or a
        group's own idle chunks under ``own_first``): marks cleared, re-stamped as young."""
        while queue:
            c = next(iter(queue))
            if not self.chunk_hit(c):
                return
            h = self.owner[c]
            f = self.first[h][c]
            bpc = self.bpc[h]
            self.hit[h][f : f + bpc] = self.hit[h][f : f + bpc].translate(_SPEND)
            self.clock += 1
            self.idle_all[c] = self.clock
            self.idle_all.move_to_end(c)
            self.idle[h].move_to_end(c)

    # -- chunk transitions --------------------------------------------------------------------
    def _carve(self, g: int, c: int) -> None:
        self.owner[c] = g
        f = self.first[g][c]
        ids = range(f + self.bpc[g] - 1, f - 1, -1)
        self.free_uncached[g].update(dict.fromkeys(ids))
        self.fill.add_range(g, c, ids)

    def _activate(self, g: int, c: int, exclude: int) -> None:
        """Idle chunk ``c`` becomes active: its free blocks (but ``exclude``) join g's queues,
        the cached ones at the most-recently-used end of the LRU, each with a new stamp."""
        f = self.first[g][c]
        hashes, fu, fc = self.hashes[g], self.free_uncached[g], self.free_cached[g]
        for x in range(f + self.bpc[g] - 1, f - 1, -1):
            if x == exclude:
                continue
            if hashes[x] is None:
                fu[x] = None
                self.fill.add(g, c, x)
            else:
                self.clock += 1
                fc[x] = self.clock

    def _reclaim(self, c: int) -> None:
        """Evict every cached block of idle chunk ``c`` and return it to nobody."""
        h = self.owner[c]
        f = self.first[h][c]
        hashes, m = self.hashes[h], self.maps[h]
        evicted: list[int] = []
        where: list[int] = []
        for x in range(f, f + self.bpc[h]):
            hx = hashes[x]
            if hx is not None:
                del m[hx]
                hashes[x] = None
                evicted.append(hx)
                where.append(x)
        del self.idle[h][c]
        del self.idle_all[c]
        self.chunk_cached_free[c] = 0
        self.owner[c] = -1
        if evicted and self.events.tracks_evictions:
            self.events.evicted(h, tuple(evicted), where)  # type: ignore[arg-type]

    # -- mutation -----------------------------------------------------------------------------
    def blocks_per_chunk(self, group_id: int) -> int:
        return self.bpc[group_id]

    def spreads(self, needs: Sequence[int], spreading: Mapping[int, int]) -> bool:
        bpc, fu = self.bpc, self.free_uncached
        want = 0
        for g, n in enumerate(needs):
            if not n:
                continue
            whole = spreading.get(g, 0)
            rest = max(0, n - whole - len(fu[g]))
            want += -(-whole // bpc[g]) - (-rest // bpc[g])
        return want <= len(self.free_chunks)

    def allocate_spread(self, group_id: int, n: int) -> list[int]:
        return self.allocate(group_id, n, True)

    def allocate(self, group_id: int, n: int, spread: bool = False) -> list[int]:
        g = group_id
        refs, hashes, bpc = self.refs[g], self.hashes[g], self.bpc[g]
        fu, fc, m = self.free_uncached[g], self.free_cached[g], self.maps[g]
        hitg = self.hit[g]
        crefd, ccf = self.chunk_refd, self.chunk_cached_free
        bb, cb, first = self.block_bytes[g], self.chunk_bytes, self.first[g]
        out: list[int] = []
        evicted: list[int] = []
        where_g: list[int] = []
        drain: list[int] = []  # cached blocks of an idle chunk this call reopened
        carved = 0  # blocks of the chunk this call carved last still in fu (spread)
        carved_c = -1  # that chunk
        fill = self.fill
        at = fill.at
        packs = self.packs
        while len(out) < n:
            if bpc == 1 and not fu and not drain and self.free_chunks:
                # One block per chunk: whole free chunks are the blocks, no carving (the
                # common case of equal page sizes, e.g. gpt-oss: O(1) per block, as uniform).
                free = self.free_chunks
                k = min(n - len(out), len(free))
                taken = free[-k:]
                del free[-k:]
                taken.reverse()  # the lowest chunk first, as pop() would give them
                owner = self.owner
                for c in taken:
                    owner[c] = g
                    crefd[c] += 1
                    blk = first[c]
                    refs[blk] = 1
                    hitg[blk] = 0
                    out.append(blk)
                continue
            if bpc == 1 and not fu and not drain and not fc and self.idle_all:
                # One block per chunk, nothing free: the oldest idle chunk (own first under
                # own_first) of a group with one block per chunk changes hands in place.
                own = self.idle[g]
                queue = own if self.own_first and own else self.idle_all
                if self.second_chance:
                    self._spare_idle(queue)
                c = next(iter(queue))
                ho = self.owner[c]
                if self.bpc[ho] == 1:
                    x = self.first[ho][c]
                    hx = self.hashes[ho][x]
                    assert hx is not None
                    del self.maps[ho][hx]
                    self.hashes[ho][x] = None
                    del self.idle[ho][c]
                    del self.idle_all[c]
                    ccf[c] = 0
                    if ho == g:
                        evicted.append(hx)
                        where_g.append(x)
                    elif self.events.tracks_evictions:
                        self.events.evicted(ho, (hx,), (x,))  # type: ignore[arg-type]
                    self.owner[c] = g
                    crefd[c] += 1
                    blk = first[c]
                    refs[blk] = 1
                    hitg[blk] = 0
                    out.append(blk)
                    continue
            if packs and fu and not carved and not (spread and self.free_chunks):
                # Step 1 in a run: the fullest chunk's free blocks (FillIndex.take_run: the
                # blocks single takes would give), its count raised once.
                run = fill.take_run(g, n - len(out))
                c = run[0] * bb // cb
                crefd[c] += len(run)
                for b in run:
                    del fu[b]
                    refs[b] = 1
                    hitg[b] = 0
                out += run
                continue
            if self.second_chance and not fu and not drain and not self.free_chunks:
                self._spare_own(g)  # step 3 decides next: spare the marked heads once
                own = self.idle[g]
                self._spare_idle(own if self.own_first and own else self.idle_all)
            if fu and not (spread and not carved and self.free_chunks):
                if not packs:
                    b = fu.popitem()[0]  # the carved chunk's blocks are the last added
                else:
                    b = fill.take_from(g, carved_c)  # a packing group's other takes run above
                    del fu[b]
                if carved:
                    carved -= 1
            elif drain or (
                fc
                and not self.free_chunks
                and (
                    self.own_first
                    or not self.idle_all
                    or next(iter(fc.values())) < next(iter(self.idle_all.values()))
                )
            ):
                b = drain.pop() if drain else fc.popitem(last=False)[0]
                h = hashes[b]
                assert h is not None
                del m[h]
                hashes[b] = None
                ccf[b * bb // cb] -= 1
                evicted.append(h)
                where_g.append(b)
            elif self.free_chunks:
                carved_c = self.free_chunks.pop()
                self._carve(g, carved_c)
                carved = bpc  # the next takes come from it
                continue
            elif self.idle_all:
                own = self.idle[g]
                c = next(iter(own if self.own_first and own else self.idle_all))
                if self.owner[c] == g:
                    del self.idle[g][c]
                    del self.idle_all[c]
                    f = first[c]
                    for x in range(f + bpc - 1, f - 1, -1):
                        if hashes[x] is None:
                            fu[x] = None
                            fill.add(g, c, x)
                        else:
                            drain.append(x)  # high to low: pop() evicts the lowest first
                else:
                    self._reclaim(c)
                    self._carve(g, c)
                continue
            else:
                raise InvariantError(f"ArenaPool.allocate: group {g} out of blocks ({n} wanted)")
            refs[b] = 1
            hitg[b] = 0
            c = b * bb // cb
            r = crefd[c] + 1
            crefd[c] = r
            filed = at[c]
            if filed >= 0 and filed != r:  # a block taken from fu is filed there already
                fill.moved(g, c)
            out.append(b)
        for x in drain:  # left over: the chunk is active now, its cached blocks go first
            fc[x] = 0
            fc.move_to_end(x, last=False)
        self.used[g] += n
        if evicted and self.events.tracks_evictions:
            self.events.evicted(g, tuple(evicted), where_g)  # type: ignore[arg-type]
        return out

    def reset_cache(self) -> bool:
        if any(self.used):
            return False
        for g in range(self.num_groups):
            self.hit[g][:] = bytes(len(self.hit[g]))
            self.hashes[g][:] = [None] * len(self.hashes[g])
            self.maps[g].clear()
            self.free_uncached[g].clear()
            self.free_cached[g].clear()
            self.idle[g].clear()
        self.idle_all.clear()
        self.clock = 0
        nc = self.num_chunks
        self.owner[:] = [-1] * nc
        self.chunk_refd[:] = [0] * nc
        self.chunk_cached_free[:] = [0] * nc
        self.free_chunks[:] = range(self.whole_chunks - 1, 0, -1)
        self.fill.reset()
        self._pin_loans()
        return True

    # -- queries ------------------------------------------------------------------------------
    def num_free(self, group_id: int) -> int:
        g = group_id
        chunks = len(self.free_chunks) + len(self.idle_all)
        return len(self.free_uncached[g]) + len(self.free_cached[g]) + chunks * self.bpc[g]

    @property
    def usage(self) -> float:
        return self.used_bytes / self._usable_bytes

    @property
    def used_bytes(self) -> int:
        return sum(u * bb for u, bb in zip(self.used, self.block_bytes, strict=True))

    def num_used(self, group_id: int) -> int:
        return self.used[group_id]

    def chunk_owner(self, chunk: int) -> int | None:
        if not 0 <= chunk < self.num_chunks:
            raise LayoutMismatchError(
                f"chunk_owner: chunk {chunk} is not a chunk of this arena; valid: "
                f"[0, {self.num_chunks})"
            )
        owner = self.owner[chunk]
        return None if owner < 0 else owner

    # -- invariants ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        check_arena(self)

    def snapshot(self) -> Any:
        return (
            [list(r) for r in self.refs],
            [list(h) for h in self.hashes],
            [list(m.items()) for m in self.maps],
            [list(q) for q in self.free_uncached],
            [list(q.items()) for q in self.free_cached],
            [list(q) for q in self.idle],
            list(self.idle_all.items()),
            self.clock,
            list(self.owner),
            list(self.chunk_refd),
            list(self.chunk_cached_free),
            list(self.free_chunks),
            list(self.used),
            [bytes(h) for h in self.hit],
            self.fill.snapshot(),
        )
