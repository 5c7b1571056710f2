"""Invariants of the ``arena`` block pool (:mod:`hybridkv.cache.pool_arena`), checked in full.

:func:`check_arena` is what :meth:`ArenaPool.check_invariants` runs: O(blocks + chunks), for
tests and debugging, never on the hot path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hybridkv.errors import InvariantError
from hybridkv.plan.layout import NULL_BLOCK_ID

if TYPE_CHECKING:
    from hybridkv.cache.pool_arena import ArenaPool

__all__ = ["check_arena"]


def check_arena(pool: ArenaPool) -> None:
    """Raise :class:`InvariantError` on any inconsistency of ``pool``'s structures: chunk
    states and counters, queues, hash maps, and the stamp order of both LRUs.  Reads only."""
    nc = pool.num_chunks
    free_set = set(pool.free_chunks)
    if len(free_set) != len(pool.free_chunks) or 0 in free_set:
        raise InvariantError(f"free-chunk stack is malformed: {pool.free_chunks}")
    idle_union: set[int] = set()
    for g in range(pool.num_groups):
        if idle_union & pool.idle[g].keys():
            raise InvariantError(f"a chunk is idle in group {g} and another group")
        idle_union |= pool.idle[g].keys()
    if idle_union != pool.idle_all.keys():
        raise InvariantError("per-group idle chunks differ from the global idle LRU")
    _check_stamps("global idle LRU", list(pool.idle_all.values()), 1, pool.clock, strict=True)
    for g in range(pool.num_groups):
        if list(pool.idle[g]) != [c for c in pool.idle_all if c in pool.idle[g]]:
            raise InvariantError(f"group {g}: idle chunks out of the global LRU's order")
        _check_stamps(f"group {g} LRU", list(pool.free_cached[g].values()), 0, pool.clock)
    for g in range(pool.num_groups):
        if pool.caps[g] < max(pool.hit[g], default=0):
            raise InvariantError(f"group {g}: a block holds more than {pool.caps[g]} chances")
        refs, hashes = pool.refs[g], pool.hashes[g]
        if refs[NULL_BLOCK_ID] or hashes[NULL_BLOCK_ID] is not None:
            raise InvariantError(f"group {g}: null block has a reference or a hash")
        for h, b in pool.maps[g].items():
            if hashes[b] != h or pool.owner[_chunk_of(pool, g, b)] != g:
                raise InvariantError(f"group {g} maps hash {h:#x} to block {b} lacking it")
        for b, (r, bh) in enumerate(zip(refs, hashes, strict=True)):
            if (r or bh is not None) and b not in _lent(pool, g, _chunk_of(pool, g, b)):
                raise InvariantError(f"group {g}: block {b} is used but no chunk lends it")
        if sum(1 for h in hashes if h is not None) != len(pool.maps[g]):
            raise InvariantError(f"group {g}: cached blocks and map entries differ")
        if sum(1 for r in refs if r) != pool.used[g]:
            raise InvariantError(f"group {g}: used counter {pool.used[g]} is wrong")
        for q, name in ((pool.free_uncached[g], "uncached"), (pool.free_cached[g], "LRU")):
            for b in q:
                c = _chunk_of(pool, g, b)
                if pool.owner[c] != g or not pool.chunk_refd[c] or refs[b]:
                    raise InvariantError(f"group {g}: block {b} in the {name} queue wrongly")
                if (hashes[b] is None) != (name == "uncached"):
                    raise InvariantError(f"group {g}: block {b} in the wrong free queue")
    pool.fill.check(pool.owner, pool.free_uncached)
    _check_loan(pool, 0, "null", free_set)
    for c in range(1, pool.whole_chunks):
        _check_chunk(pool, c, free_set)
    if pool.tail_host is not None:
        _check_loan(pool, pool.whole_chunks, "tail", free_set)
    if nc != pool.whole_chunks + (pool.tail_host is not None):
        raise InvariantError(f"{nc} chunks for {pool.whole_chunks} whole ones and the tail")


def _check_loan(pool: ArenaPool, c: int, name: str, free_set: set[int]) -> None:
    """Chunk ``c`` lent for good (chunk 0 to the null host, the tail to the tail host): held by
    its host with a phantom reference, lending only ``[first, end)``, its free blocks always in
    the host's queues.  Chunk 0 without a null host is unowned (reserved)."""
    host = pool.null_host if c == 0 else pool.tail_host
    if host is None:
        if pool.owner[c] != -1 or pool.chunk_refd[c] or pool.chunk_cached_free[c]:
            raise InvariantError(f"chunk {c} (null blocks) is used though it has no null host")
        return
    g = host.group_id
    if pool.owner[c] != g or c in free_set or c in pool.idle_all:
        raise InvariantError(f"chunk {c} is not held for good by its {name} host, group {g}")
    for o in range(pool.num_groups):
        if o != g:
            for x in _lent(pool, o, c):
                if pool.refs[o][x] or pool.hashes[o][x] is not None:
                    raise InvariantError(f"chunk {c}: group {o} uses block {x} it does not hold")
    refs, hashes = pool.refs[g], pool.hashes[g]
    fu, fc = pool.free_uncached[g], pool.free_cached[g]
    for x in range(pool.first[g][c], host.first):
        if refs[x] or hashes[x] is not None or x in fu or x in fc:
            raise InvariantError(f"chunk {c}: block {x} of group {g} before the loan is in use")
    blocks = range(host.first, host.end)
    refd = sum(1 for x in blocks if refs[x])
    cached_free = sum(1 for x in blocks if not refs[x] and hashes[x] is not None)
    if refd + 1 != pool.chunk_refd[c] or cached_free != pool.chunk_cached_free[c]:
        raise InvariantError(
            f"chunk {c}: counters (refd {pool.chunk_refd[c]}, cached free "
            f"{pool.chunk_cached_free[c]}) differ from blocks ({refd} + 1, {cached_free})"
        )
    for x in blocks:
        if not refs[x] and (x in fu) == (x in fc):
            raise InvariantError(f"chunk {c}: free block {x} not in exactly one queue")


def _chunk_of(pool: ArenaPool, g: int, b: int) -> int:
    return b * pool.block_bytes[g] // pool.chunk_bytes


def _lent(pool: ArenaPool, g: int, c: int) -> range:
    """The block ids chunk ``c`` lends group ``g`` (the loan's ids for its host; the tail
    lends no other group anything)."""
    if c == pool.whole_chunks:
        host = pool.tail_host
        return range(host.first, host.end) if host is not None and host.group_id == g else range(0)
    return range(pool.first[g][c], pool.first[g][c] + pool.bpc[g])


def _check_chunk(pool: ArenaPool, c: int, free_set: set[int]) -> None:
    owner = pool.owner[c]
    for g in range(pool.num_groups):
        if g == owner:
            continue
        for x in _lent(pool, g, c):
            if pool.refs[g][x] or pool.hashes[g][x] is not None:
                raise InvariantError(f"chunk {c}: group {g} uses block {x} it does not hold")
    if owner < 0:
        if c not in free_set or pool.chunk_refd[c] or pool.chunk_cached_free[c]:
            raise InvariantError(f"chunk {c} has no owner but is not cleanly free")
        return
    if c in free_set:
        raise InvariantError(f"chunk {c} is owned by group {owner} and on the free stack")
    refs, hashes = pool.refs[owner], pool.hashes[owner]
    fu, fc = pool.free_uncached[owner], pool.free_cached[owner]
    blocks = _lent(pool, owner, c)
    refd = sum(1 for x in blocks if refs[x])
    cached_free = sum(1 for x in blocks if not refs[x] and hashes[x] is not None)
    if refd != pool.chunk_refd[c] or cached_free != pool.chunk_cached_free[c]:
        raise InvariantError(
            f"chunk {c}: counters (refd {pool.chunk_refd[c]}, cached free "
            f"{pool.chunk_cached_free[c]}) differ from blocks ({refd}, {cached_free})"
        )
    idle = c in pool.idle[owner]
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


def _check_stamps(name: str, stamps: list[int], lo: int, hi: int, *, strict: bool = False) -> None:
    """Raise InvariantError unless ``stamps`` are in ``[lo, hi]`` and (strictly) increasing."""
    for i, s in enumerate(stamps):
        if not lo <= s <= hi:
            raise InvariantError(f"{name}: stamp {s} outside [{lo}, {hi}]")
        if i and (s < stamps[i - 1] or (strict and s == stamps[i - 1])):
            raise InvariantError(
                f"{name}: stamps out of order at position {i}: {stamps[i - 1]}, {s}"
            )
