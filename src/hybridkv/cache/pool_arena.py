"""The ``arena`` strategy: one region of chunks, carved into blocks by the group holding each.

Chunk ``c`` of group ``g`` holds ``g``'s block ids ``[c * bpc(g), (c + 1) * bpc(g))`` where
``bpc(g) = chunk_bytes // block_bytes(g)`` (see :mod:`hybridkv.plan.layout`).  Chunk 0 is
reserved for the null blocks.  A chunk is in one of three states:

* **free**: held by nobody, on the arena's free-chunk stack;
* **active**: held by group ``g`` with at least one referenced block; its free blocks wait in
  ``g``'s queues (uncached LIFO, cached LRU);
* **idle**: held by ``g``, no referenced block, at least one cached block; its blocks are in no
  queue (hits can still revive them), the chunk waits in ``g``'s idle LRU and the global one.

A chunk whose blocks are all free and uncached returns to the free stack at once, so memory
flows to whichever group needs it.  Group ``g`` takes a block from, in order:

1. an uncached free block of one of its active chunks;
2. a free chunk (carved for ``g``);
3. the least-recently idled chunk of *any* group: its own is reopened and used whole (its
   cached blocks evicted first), another group's is emptied (cached blocks evicted) and carved;
4. its own cached LRU inside its active chunks.

Step 3 is an LRU over whole chunks across groups, so groups lose cached prefixes of the same
age together (independent per-group LRUs drift apart: each group keeps prefixes the others
already lost, and the hit, which needs all groups, shrinks).  Step 4 only runs when every chunk
holds a referenced block.  The ``own_first`` policy instead evicts per group: after step 2 a
group evicts its own cached blocks in active chunks, then reopens its own idle chunks, and
only then empties another group's least-recently idled chunk (on the benchmark's 3-group
layout this loses about half the hit rate; see ``benchmarks/bench_manager.py``).

Either order makes feasibility countable (:meth:`ArenaPool.fits` is exact).  Chunk
transitions (carve, reopen, idle, reclaim) cost O(blocks per chunk); every other operation is
O(1) per block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, ClassVar

from hybridkv.cache.events import EventLog
from hybridkv.cache.pool_base import BlockPool, GroupLists
from hybridkv.errors import InvariantError, PlanError
from hybridkv.plan.layout import NULL_BLOCK_ID, MemoryLayout, Strategy

__all__ = ["ARENA_EVICTION_POLICIES", "ArenaPool"]

#: ``chunk_lru`` (default): steps 1, 2, 3, 4 below.  ``own_first``: a group evicts its own
#: cached blocks (active chunks, then its idle chunks) before emptying another group's chunk.
ARENA_EVICTION_POLICIES = ("chunk_lru", "own_first")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class ArenaPool(BlockPool):
    """Chunks shared by every group of an ``arena`` layout."""

    strategy: ClassVar[Strategy] = Strategy.ARENA
    reads_cached_hint: ClassVar[bool] = True

    def __init__(
        self, layout: MemoryLayout, events: EventLog, *, eviction: str = "chunk_lru"
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
        nc = arena.num_chunks
        groups = range(self.num_groups)
        self.num_chunks = nc
        self.chunk_bytes = arena.chunk_bytes
        self.bpc = [layout.blocks_per_chunk(g) for g in groups]
        self.block_bytes = [layout.groups[g].block_bytes for g in groups]
        self.refs = [[0] * (nc * self.bpc[g]) for g in groups]
        self.hashes = [[None] * (nc * self.bpc[g]) for g in groups]
        self.maps = [{} for _ in groups]
        self.free_uncached: list[dict[int, None]] = [{} for _ in groups]
        self.free_cached: list[OrderedDict[int, None]] = [OrderedDict() for _ in groups]
        self.idle: list[OrderedDict[int, None]] = [OrderedDict() for _ in groups]
        self.idle_all: OrderedDict[int, None] = OrderedDict()
        self.owner = [-1] * nc
        self.chunk_refd = [0] * nc  # referenced blocks per chunk
        self.chunk_cached_free = [0] * nc  # free blocks holding a hash, per chunk
        self.free_chunks = list(range(nc - 1, 0, -1))  # pop() gives the lowest first
        self.used = [0] * self.num_groups

    # -- chunk transitions --------------------------------------------------------------------
    def _carve(self, g: int, c: int) -> None:
        self.owner[c] = g
        bpc = self.bpc[g]
        self.free_uncached[g].update(dict.fromkeys(range((c + 1) * bpc - 1, c * bpc - 1, -1)))

    def _activate(self, g: int, c: int, exclude: int) -> None:
        """Idle chunk ``c`` becomes active: its free blocks (but ``exclude``) join g's queues."""
        bpc = self.bpc[g]
        hashes, fu, fc = self.hashes[g], self.free_uncached[g], self.free_cached[g]
        for x in range((c + 1) * bpc - 1, c * bpc - 1, -1):
            if x == exclude:
                continue
            if hashes[x] is None:
                fu[x] = None
            else:
                fc[x] = None

    def _reclaim(self, c: int) -> None:
        """Evict every cached block of idle chunk ``c`` and return it to nobody."""
        h = self.owner[c]
        bpc = self.bpc[h]
        hashes, m = self.hashes[h], self.maps[h]
        evicted: list[int] = []
        for x in range(c * bpc, (c + 1) * bpc):
            hx = hashes[x]
            if hx is not None:
                del m[hx]
                hashes[x] = None
                evicted.append(hx)
        del self.idle[h][c]
        del self.idle_all[c]
        self.chunk_cached_free[c] = 0
        self.owner[c] = -1
        if evicted and self.events.enabled:
            self.events.removed(h, tuple(evicted))  # type: ignore[arg-type]

    # -- mutation -----------------------------------------------------------------------------
    def allocate(self, group_id: int, n: int) -> list[int]:
        g = group_id
        refs, hashes, bpc = self.refs[g], self.hashes[g], self.bpc[g]
        fu, fc, m = self.free_uncached[g], self.free_cached[g], self.maps[g]
        crefd, ccf = self.chunk_refd, self.chunk_cached_free
        out: list[int] = []
        evicted: list[int] = []
        drain: list[int] = []  # cached blocks of an idle chunk this call reopened
        while len(out) < n:
            if fu:
                b = fu.popitem()[0]
            elif drain or (fc and not self.free_chunks and (self.own_first or not self.idle_all)):
                b = drain.pop() if drain else fc.popitem(last=False)[0]
                h = hashes[b]
                assert h is not None
                del m[h]
                hashes[b] = None
                ccf[b // bpc] -= 1
                evicted.append(h)
            elif self.free_chunks:
                self._carve(g, self.free_chunks.pop())
                continue
            elif self.idle_all:
                own = self.idle[g]
                c = next(iter(own if self.own_first and own else self.idle_all))
                if self.owner[c] == g:
                    del self.idle[g][c]
                    del self.idle_all[c]
                    for x in range((c + 1) * bpc - 1, c * bpc - 1, -1):
                        if hashes[x] is None:
                            fu[x] = None
                        else:
                            drain.append(x)  # high to low: pop() evicts the lowest first
                else:
                    self._reclaim(c)
                    self._carve(g, c)
                continue
            else:
                raise InvariantError(f"ArenaPool.allocate: group {g} out of blocks ({n} wanted)")
            refs[b] = 1
            crefd[b // bpc] += 1
            out.append(b)
        for x in drain:  # left over: the chunk is active now, its cached blocks go first
            fc[x] = None
            fc.move_to_end(x, last=False)
        self.used[g] += n
        if evicted and self.events.enabled:
            self.events.removed(g, tuple(evicted))  # type: ignore[arg-type]
        return out

    def touch(self, group_id: int, blocks: Sequence[int]) -> None:
        g = group_id
        refs, bpc, fc = self.refs[g], self.bpc[g], self.free_cached[g]
        crefd, ccf = self.chunk_refd, self.chunk_cached_free
        for b in blocks:
            r = refs[b]
            if not r:
                c = b // bpc
                if crefd[c]:
                    del fc[b]
                else:
                    del self.idle[g][c]
                    del self.idle_all[c]
                    self._activate(g, c, b)
                ccf[c] -= 1
                crefd[c] += 1
                self.used[g] += 1
            refs[b] = r + 1

    def release(self, group_id: int, blocks: Sequence[int]) -> None:
        g = group_id
        refs, hashes, bpc = self.refs[g], self.hashes[g], self.bpc[g]
        fu, fc = self.free_uncached[g], self.free_cached[g]
        crefd, ccf = self.chunk_refd, self.chunk_cached_free
        for b in blocks:
            r = refs[b] - 1
            refs[b] = r
            if r:
                continue
            self.used[g] -= 1
            c = b // bpc
            left = crefd[c] - 1
            crefd[c] = left
            cached = hashes[b] is not None
            if left:
                if cached:
                    fc[b] = None
                    ccf[c] += 1
                else:
                    fu[b] = None
                continue
            # No referenced block left: the chunk's other (free) blocks leave g's queues.
            for x in range(c * bpc, (c + 1) * bpc):
                if x != b:
                    if hashes[x] is None:
                        del fu[x]
                    else:
                        del fc[x]
            if cached:
                ccf[c] += 1
            if ccf[c]:
                self.idle[g][c] = None
                self.idle_all[c] = None
            else:
                self.owner[c] = -1
                self.free_chunks.append(c)

    def refresh(self, group_id: int, blocks: Sequence[int]) -> None:
        g = group_id
        refs, bpc, fc = self.refs[g], self.bpc[g], self.free_cached[g]
        for b in blocks:
            if refs[b]:
                continue
            c = b // bpc
            if self.chunk_refd[c]:
                if b in fc:
                    fc.move_to_end(b)
            elif c in self.idle[g]:
                self.idle[g].move_to_end(c)
                self.idle_all.move_to_end(c)

    def reset_cache(self) -> bool:
        if any(self.used):
            return False
        for g in range(self.num_groups):
            self.hashes[g][:] = [None] * len(self.hashes[g])
            self.maps[g].clear()
            self.free_uncached[g].clear()
            self.free_cached[g].clear()
            self.idle[g].clear()
        self.idle_all.clear()
        nc = self.num_chunks
        self.owner[:] = [-1] * nc
        self.chunk_refd[:] = [0] * nc
        self.chunk_cached_free[:] = [0] * nc
        self.free_chunks[:] = range(nc - 1, 0, -1)
        return True

    # -- queries ------------------------------------------------------------------------------
    def fits(
        self,
        cached: Sequence[set[int] | None],
        releases: GroupLists,
        touches: GroupLists,
        needs: Sequence[int],
    ) -> bool:
        free_chunks = len(self.free_chunks)
        idle = len(self.idle_all)
        unc = [len(q) for q in self.free_uncached]
        cac = [len(q) for q in self.free_cached]
        crefd, ccf = self.chunk_refd, self.chunk_cached_free
        sim: dict[int, list[int]] = {}  # chunk -> [referenced, cached free] as simulated
        for g in range(self.num_groups):
            rel = releases[g]
            if not rel:
                continue
            refs, hashes, bpc = self.refs[g], self.hashes[g], self.bpc[g]
            to_cache = cached[g] or ()
            for b in rel:
                if refs[b] != 1:
                    continue
                c = b // bpc
                st = sim.get(c)
                if st is None:
                    st = sim[c] = [crefd[c], ccf[c]]
                is_cached = hashes[b] is not None or b in to_cache
                st[0] -= 1
                if st[0]:
                    if is_cached:
                        cac[g] += 1
                        st[1] += 1
                    else:
                        unc[g] += 1
                    continue
                unc[g] -= bpc - 1 - st[1]
                cac[g] -= st[1]
                if is_cached:
                    st[1] += 1
                if st[1]:
                    idle += 1
                else:
                    free_chunks += 1
        for g in range(self.num_groups):
            tch = touches[g]
            if not tch:
                continue
            refs, bpc = self.refs[g], self.bpc[g]
            for b in tch:
                if refs[b]:
                    continue
                c = b // bpc
                st = sim.get(c)
                if st is None:
                    st = sim[c] = [crefd[c], ccf[c]]
                if not st[0]:
                    idle -= 1
                    unc[g] += bpc - st[1]
                    cac[g] += st[1]
                st[0] += 1
                st[1] -= 1
                cac[g] -= 1
        for g, n in enumerate(needs):
            if not n:
                continue
            n -= min(n, unc[g])
            if n:
                bpc = self.bpc[g]
                k = min(free_chunks, _cdiv(n, bpc))
                free_chunks -= k
                n = max(0, n - k * bpc)
                if n and self.own_first:
                    n -= min(n, cac[g])
                    k = _cdiv(n, bpc)
                    if k > idle:
                        return False
                    idle -= k
                elif n:
                    k = min(idle, _cdiv(n, bpc))
                    idle -= k
                    n = max(0, n - k * bpc)
                    if n > cac[g]:
                        return False
        return True

    def num_free(self, group_id: int) -> int:
        g = group_id
        chunks = len(self.free_chunks) + len(self.idle_all)
        return len(self.free_uncached[g]) + len(self.free_cached[g]) + chunks * self.bpc[g]

    @property
    def usage(self) -> float:
        used = sum(u * bb for u, bb in zip(self.used, self.block_bytes, strict=True))
        return used / ((self.num_chunks - 1) * self.chunk_bytes)

    def num_used(self, group_id: int) -> int:
        return self.used[group_id]

    def chunk_owner(self, chunk: int) -> int | None:
        if not 0 <= chunk < self.num_chunks:
            raise InvariantError(f"chunk_owner: chunk {chunk} not in [0, {self.num_chunks})")
        owner = self.owner[chunk]
        return None if owner < 0 else owner

    # -- invariants ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        nc = self.num_chunks
        free_set = set(self.free_chunks)
        if len(free_set) != len(self.free_chunks) or 0 in free_set:
            raise InvariantError(f"free-chunk stack is malformed: {self.free_chunks}")
        idle_union: set[int] = set()
        for g in range(self.num_groups):
            if idle_union & self.idle[g].keys():
                raise InvariantError(f"a chunk is idle in group {g} and another group")
            idle_union |= self.idle[g].keys()
        if idle_union != self.idle_all.keys():
            raise InvariantError("per-group idle chunks differ from the global idle LRU")
        for g in range(self.num_groups):
            refs, hashes = self.refs[g], self.hashes[g]
            if refs[NULL_BLOCK_ID] or hashes[NULL_BLOCK_ID] is not None:
                raise InvariantError(f"group {g}: null block has a reference or a hash")
            for h, b in self.maps[g].items():
                if hashes[b] != h or self.owner[b // self.bpc[g]] != g:
                    raise InvariantError(f"group {g} maps hash {h:#x} to block {b} lacking it")
            if sum(1 for h in hashes if h is not None) != len(self.maps[g]):
                raise InvariantError(f"group {g}: cached blocks and map entries differ")
            if sum(1 for r in refs if r) != self.used[g]:
                raise InvariantError(f"group {g}: used counter {self.used[g]} is wrong")
            for q, name in ((self.free_uncached[g], "uncached"), (self.free_cached[g], "LRU")):
                for b in q:
                    c = b // self.bpc[g]
                    if self.owner[c] != g or not self.chunk_refd[c] or refs[b]:
                        raise InvariantError(f"group {g}: block {b} in the {name} queue wrongly")
                    if (hashes[b] is None) != (name == "uncached"):
                        raise InvariantError(f"group {g}: block {b} in the wrong free queue")
        if self.owner[0] != -1:
            raise InvariantError("chunk 0 (null blocks) is owned by a group")
        for c in range(1, nc):
            self._check_chunk(c, free_set)

    def _check_chunk(self, c: int, free_set: set[int]) -> None:
        owner = self.owner[c]
        for g in range(self.num_groups):
            if g == owner:
                continue
            bpc = self.bpc[g]
            for x in range(c * bpc, (c + 1) * bpc):
                if self.refs[g][x] or self.hashes[g][x] is not None:
                    raise InvariantError(f"chunk {c}: group {g} uses block {x} it does not hold")
        if owner < 0:
            if c not in free_set or self.chunk_refd[c] or self.chunk_cached_free[c]:
                raise InvariantError(f"chunk {c} has no owner but is not cleanly free")
            return
        if c in free_set:
            raise InvariantError(f"chunk {c} is owned by group {owner} and on the free stack")
        bpc = self.bpc[owner]
        refs, hashes = self.refs[owner], self.hashes[owner]
        fu, fc = self.free_uncached[owner], self.free_cached[owner]
        blocks = range(c * bpc, (c + 1) * bpc)
        refd = sum(1 for x in blocks if refs[x])
        cached_free = sum(1 for x in blocks if not refs[x] and hashes[x] is not None)
        if refd != self.chunk_refd[c] or cached_free != self.chunk_cached_free[c]:
            raise InvariantError(
                f"chunk {c}: counters (refd {self.chunk_refd[c]}, cached free "
                f"{self.chunk_cached_free[c]}) differ from blocks ({refd}, {cached_free})"
            )
        idle = c in self.idle[owner]
        if refd:
            if idle:
                raise InvariantError(f"chunk {c} has referenced blocks but is idle")
            for x in blocks:
                if not refs[x] and (x in fu) == (x in fc):
                    raise InvariantError(f"chunk {c}: free block {x} not in exactly one queue")
        else:
            if not cached_free or not idle:
                raise InvariantError(f"chunk {c} is unreferenced but not idle with cached data")
            if any(x in fu or x in fc for x in blocks):
                raise InvariantError(f"idle chunk {c} has blocks in free queues")

    def snapshot(self) -> Any:
        return (
            [list(r) for r in self.refs],
            [list(h) for h in self.hashes],
            [list(m.items()) for m in self.maps],
            [list(q) for q in self.free_uncached],
            [list(q) for q in self.free_cached],
            [list(q) for q in self.idle],
            list(self.idle_all),
            list(self.owner),
            list(self.chunk_refd),
            list(self.chunk_cached_free),
            list(self.free_chunks),
            list(self.used),
        )
