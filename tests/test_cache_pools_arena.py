"""Arena block pools: chunks carved, lent, reclaimed and spared, spread allocations, and the
flat one-group / equal-page arena."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache import KVCacheManager, LayoutMismatchError, TierSpec, compiled
from hybridkv.cache.events import BlockRemoved, EventLog
from hybridkv.cache.pool_arena import ArenaPool
from hybridkv.cache.pool_shared import FlatArenaPool
from hybridkv.cache.pools import make_block_pool
from hybridkv.cache.request import Request
from hybridkv.errors import InvariantError, PlanError
from hybridkv.specs import CacheSpec
from test_cache_factories import (
    arena,
    chunked,
    full,
    groups,
    state,
    swa,
    uniform,
)


def _hold_null_chunk(pool: ArenaPool) -> list[int]:
    """Allocate (and keep) what chunk 0 lends the null host, so a test's chunk mechanics
    start from chunk 1."""
    host = pool.null_host
    assert host is not None
    return pool.allocate(host.group_id, host.end - host.first)


def test_chunk_zero_is_lent_to_the_null_host_past_the_null_region() -> None:
    # Null region: the largest attention block, 256 bytes; chunk 0 lends group 0 (128-byte
    # blocks) ids 2..3, group 1 (256-byte) only id 1: equal bytes, the lower group hosts.
    layout = arena(groups(full(), (full(), 8)), 4)
    assert layout.null_host == (0, 2, 4)
    pool = ArenaPool(layout, EventLog(enabled=False))
    assert pool.chunk_owner(0) == 0 and pool.num_free(0) == 2 + 3 * 4
    assert pool.allocate(0, 3) == [2, 3, 4]  # chunk 0's, then chunk 1 is carved
    pool.release(0, [2, 3, 4])  # chunk 1 returns to the arena, chunk 0 stays group 0's
    assert [pool.chunk_owner(c) for c in range(4)] == [0, None, None, None]
    assert pool.allocate(1, 6) == [2, 3, 4, 5, 6, 7]  # group 1 never gets chunk 0
    with pytest.raises(InvariantError):
        pool.allocate(1, 1)
    assert pool.usage == pytest.approx(6 * 256 / (3 * 512 + 2 * 128))
    assert pool.used_bytes == 6 * 256  # exact, where usage x total would count chunk 0
    pool.check_invariants()
    # A state group's null block is never read: with no attention group there is no null
    # region, only id 0 itself is kept back.
    assert arena(groups(state()), 3, blocks_per_chunk=4).null_host == (0, 1, 4)
    assert arena(groups(full(), full()), 3, blocks_per_chunk=1).null_host is None


def test_the_tail_past_the_last_chunk_is_lent_to_the_tail_host() -> None:
    # 3 chunks of 512 B and 511 B past them: group 0 (128-byte blocks) gets ids 12..14 there,
    # group 1 (256-byte) only id 6: group 0 hosts the tail, a pseudo-chunk 3 held for good.
    layout = arena(groups(full(), (full(), 8)), 3, tail=True)
    assert layout.tail_host == (0, 12, 15) and layout.tail_usable_bytes == 384
    assert layout.total_bytes == 3 * 512 + 511 and layout.num_block_ids(1) == 7
    pool = ArenaPool(layout, EventLog(enabled=True))
    assert [pool.chunk_owner(c) for c in range(4)] == [0, None, None, 0]
    assert pool.num_free(0) == 2 + 3 + 2 * 4 and pool.num_free(1) == 2 * 2
    assert pool.allocate(0, 6) == [12, 13, 14, 2, 3, 4]  # the loans first, then chunk 1
    pool.cache(0, 12, 112)
    pool.release(0, [12, 13])  # the tail never goes idle: 112 waits in group 0's LRU
    assert pool.chunk_owner(3) == 0 and list(pool.free_cached[0]) == [12]
    assert pool.allocate(1, 2) == [4, 5]  # chunk 2; group 1 never gets the tail
    with pytest.raises(InvariantError):
        pool.allocate(1, 1)
    assert pool.allocate(0, 5) == [13, 5, 6, 7, 12]  # uncached first, then 112 is evicted
    assert pool.events.take() == [BlockRemoved(0, (112,))]  # type: ignore[arg-type]
    assert pool.usage == pytest.approx((9 * 128 + 2 * 256) / (2 * 512 + 2 * 128 + 384))
    assert pool.used_bytes == 9 * 128 + 2 * 256
    pool.check_invariants()
    assert pool.reset_cache() is False
    pool.release(0, [2, 3, 4, 13, 5, 6, 7, 12, 14])
    pool.release(1, [4, 5])
    assert pool.reset_cache() and pool.chunk_owner(3) == 0 and pool.num_free(0) == 13
    pool.check_invariants()
    # A group with one block per chunk moves whole chunks and never hosts a loan.
    assert arena(groups(full(), full()), 3, blocks_per_chunk=1, tail=True).tail_host is None


def test_arena_chunks_are_carved_returned_and_reclaimed() -> None:
    # Group 0: 128-byte blocks (4 per 512-byte chunk); group 1: 256-byte blocks (2 per chunk).
    layout = arena(groups(full(), (full(), 8)), 4)
    assert layout.arena is not None and layout.arena.chunk_bytes == 512
    pool = ArenaPool(layout, EventLog(enabled=True))
    assert _hold_null_chunk(pool) == [2, 3]
    assert pool.allocate(0, 1) == [4]  # chunk 1 -> group 0, blocks 4..7
    assert pool.allocate(1, 1) == [4]  # chunk 2 -> group 1, blocks 4..5
    assert [pool.chunk_owner(c) for c in range(4)] == [0, 0, 1, None]
    pool.cache(0, 4, 111)
    pool.release(0, [4])  # chunk 1 keeps a cached block: idle, still group 0's
    pool.release(1, [4])  # chunk 2 is all free and uncached: back to the arena
    assert [pool.chunk_owner(c) for c in range(4)] == [0, 0, None, None]
    pool.check_invariants()
    assert pool.num_free(1) == 3 * 2
    assert pool.allocate(1, 4) == [4, 5, 6, 7]  # chunks 2 and 3
    assert pool.allocate(1, 1) == [2]  # no free chunk: group 0's idle chunk 1 is reclaimed
    assert pool.events.take() == [BlockRemoved(0, (111,))]  # type: ignore[arg-type]
    assert [pool.chunk_owner(c) for c in range(4)] == [0, 1, 1, 1]
    assert pool.maps[0] == {} and pool.is_allocated(1, 2) and not pool.is_allocated(0, 4)
    pool.check_invariants()


def test_arena_reopens_its_own_idle_chunk_lowest_cached_block_first() -> None:
    pool = ArenaPool(arena(groups(full()), 2, blocks_per_chunk=4), EventLog(enabled=False))
    assert _hold_null_chunk(pool) == [1, 2, 3]
    assert pool.allocate(0, 4) == [4, 5, 6, 7]
    pool.cache(0, 5, 55)
    pool.cache(0, 7, 77)
    pool.release(0, [7, 6, 5, 4])  # chunk 1 idle: 5 and 7 cached
    assert pool.chunk_owner(1) == 0 and pool.num_free(0) == 4
    assert pool.allocate(0, 3) == [4, 6, 5]  # uncached blocks, then evict 5 (lowest first)
    assert pool.maps[0] == {77: 7}
    pool.check_invariants()
    assert pool.allocate(0, 1) == [7]
    with pytest.raises(InvariantError):
        pool.allocate(0, 1)


def test_arena_own_first_evicts_its_own_blocks_before_other_groups_chunks() -> None:
    layout = arena(groups(full(), full()), 3, blocks_per_chunk=2)
    for policy, expected in (("chunk_lru", [2]), ("own_first", [5])):
        pool = ArenaPool(layout, EventLog(enabled=False), eviction=policy)
        assert _hold_null_chunk(pool) == [1]
        assert pool.allocate(0, 2) == [2, 3]  # chunk 1: group 0
        assert pool.allocate(1, 2) == [4, 5]  # chunk 2: group 1
        pool.cache(0, 2, 20)
        pool.release(0, [3, 2])  # chunk 1 idle (older)
        pool.cache(1, 5, 50)
        pool.release(1, [5])  # group 1's cached block 5 in its active chunk
        assert pool.allocate(1, 1) == expected
        pool.check_invariants()
    with pytest.raises(PlanError, match="valid: chunk_lru, own_first"):
        ArenaPool(layout, EventLog(enabled=False), eviction="fifo")


def test_arena_evicts_its_older_cached_block_before_a_newer_idle_chunk() -> None:
    layout = arena(groups(full(), full()), 3, blocks_per_chunk=2)
    pool = ArenaPool(layout, EventLog(enabled=True))
    assert _hold_null_chunk(pool) == [1]
    assert pool.allocate(0, 2) == [2, 3]  # chunk 1: group 0
    assert pool.allocate(1, 2) == [4, 5]  # chunk 2: group 1
    pool.cache(1, 5, 50)
    pool.release(1, [5])  # stamp 1: group 1's cached block in its active chunk
    pool.cache(0, 2, 20)
    pool.release(0, [3, 2])  # stamp 2: chunk 1 idle, newer than block 5
    assert list(pool.free_cached[1].items()) == [(5, 1)]
    assert list(pool.idle_all.items()) == [(1, 2)]
    nothing = [None, None]
    assert pool.fits(nothing, nothing, nothing, [0, 3])  # block 5, then chunk 1's two blocks
    assert not pool.fits(nothing, nothing, nothing, [0, 4])
    assert pool.allocate(1, 1) == [5]  # the older of the two: group 1's own block
    assert pool.maps[1] == {} and pool.maps[0] == {20: 2}
    assert pool.events.take()[-1] == BlockRemoved(1, (50,))  # type: ignore[arg-type]
    pool.check_invariants()
    assert pool.allocate(1, 1) == [2]  # then the idle chunk, emptied and carved
    assert pool.chunk_owner(1) == 1 and pool.maps[0] == {}
    pool.check_invariants()


def test_arena_refresh_makes_an_idle_chunk_younger_than_cached_blocks() -> None:
    layout = arena(groups(full(), full()), 3, blocks_per_chunk=2)
    pool = ArenaPool(layout, EventLog(enabled=False))
    assert _hold_null_chunk(pool) == [1]
    assert pool.allocate(0, 2) == [2, 3]
    assert pool.allocate(1, 2) == [4, 5]
    pool.cache(0, 2, 20)
    pool.release(0, [3, 2])  # stamp 1: chunk 1 idle
    pool.cache(1, 5, 50)
    pool.release(1, [5])  # stamp 2
    pool.refresh(0, [2])  # stamp 3: chunk 1 is now the most recently used
    assert list(pool.idle_all.items()) == [(1, 3)]
    assert pool.allocate(1, 1) == [5]
    pool.check_invariants()


def test_arena_revived_chunk_siblings_rejoin_the_lru_as_recently_used() -> None:
    pool = ArenaPool(arena(groups(full(), full()), 3, blocks_per_chunk=2), EventLog(enabled=False))
    assert _hold_null_chunk(pool) == [1]
    assert pool.allocate(0, 2) == [2, 3]
    assert pool.allocate(1, 2) == [4, 5]
    pool.cache(1, 5, 50)
    pool.release(1, [5])  # stamp 1
    pool.cache(0, 2, 20)
    pool.cache(0, 3, 30)
    pool.release(0, [3, 2])  # block 3 stamp 2 (chunk still active), then chunk 1 idle: 3
    nothing = [None, None]
    # touch block 2 (sibling 3 gets stamp 4), then group 1 needs 2: block 5, then nothing left
    assert not pool.fits(nothing, nothing, [[2], None], [0, 2])
    assert pool.fits(nothing, nothing, [[2], None], [0, 1])
    pool.touch(0, [2])
    assert list(pool.free_cached[0].items()) == [(3, 4)] and not pool.idle_all
    pool.check_invariants()
    pool.release(0, [2])  # stamp 5: chunk 1 idle again with both blocks cached
    assert list(pool.idle_all.items()) == [(1, 5)] and not pool.free_cached[0]
    assert pool.allocate(1, 1) == [5]  # block 5 (stamp 1) is older than chunk 1
    pool.check_invariants()


def test_arena_touch_revives_an_idle_chunk() -> None:
    pool = ArenaPool(arena(groups(full(), state()), 3), EventLog(enabled=False))
    assert _hold_null_chunk(pool) == [1]
    assert pool.allocate(0, 2) == [2, 3]
    pool.cache(0, 2, 9)
    pool.release(0, [3, 2])
    assert pool.chunk_owner(1) == 0 and pool.free_cached[0] == {}
    pool.touch(0, [2])
    assert pool.refs[0][2] == 1 and list(pool.free_uncached[0]) == [3]
    pool.check_invariants()
    with pytest.raises(LayoutMismatchError, match=r"chunk 3 is not a chunk"):
        pool.chunk_owner(3)  # a caller's bad index, not a bookkeeping bug


def test_arena_spares_an_idle_chunk_that_served_a_hit_once() -> None:
    for chance in (True, False):
        layout = arena(groups(full(), (full(), 8)), 4)  # 512-byte chunks: 4 or 2 blocks
        pool = make_block_pool(layout, EventLog(enabled=True), second_chance=chance)
        assert isinstance(pool, ArenaPool)
        assert _hold_null_chunk(pool) == [2, 3]
        assert pool.allocate(0, 4) == [4, 5, 6, 7]  # chunk 1
        for b in (4, 5, 6, 7):
            pool.cache(0, b, 100 + b)
        pool.release(0, [4, 5, 6, 7])  # chunk 1 idle
        pool.touch(0, [4])  # a hit on block 4 ...
        pool.release(0, [4])  # ... chunk 1 idle again, its block 4 marked
        assert pool.allocate(0, 4) == [8, 9, 10, 11]  # chunk 2
        for b in (8, 9, 10, 11):
            pool.cache(0, b, 100 + b)
        pool.release(0, [8, 9, 10, 11])  # chunk 2 idle: younger than chunk 1
        assert pool.allocate(1, 2) == [6, 7]  # chunk 3 was free
        pool.events.take()
        pool.check_invariants()
        before = pool.snapshot()
        assert pool.fits([None, None], [None, None], [None, None], [0, 4])
        assert pool.snapshot() == before  # fits replays the second chance, changes nothing
        assert pool.allocate(1, 2) == ([4, 5] if chance else [2, 3])
        evicted = [e.block_hashes for e in pool.events.take()]  # type: ignore[attr-defined]
        # chunk 1 (older, but it served a hit) is spared once: chunk 2 goes instead
        assert evicted == ([(108, 109, 110, 111)] if chance else [(104, 105, 106, 107)])
        assert pool.chunk_owner(1 if chance else 2) == 0
        pool.check_invariants()
        assert not pool.fits([None, None], [None, None], [None, None], [0, 5])


def test_arena_idle_chunk_spends_one_chance_of_each_block_per_sparing() -> None:
    # Two hits on a block of idle chunk 1: it is spared twice, so two younger idle chunks go
    # first; fits replays both sparings without changing anything.
    layout = arena(groups(full(), (full(), 8)), 5)  # 512-byte chunks: 4 or 2 blocks
    pool = make_block_pool(layout, EventLog(enabled=True), second_chance=2)
    assert isinstance(pool, ArenaPool)
    assert _hold_null_chunk(pool) == [2, 3]
    for c, first in ((1, 4), (2, 8), (3, 12)):
        assert pool.allocate(0, 4) == [first, first + 1, first + 2, first + 3]
        for b in range(first, first + 4):
            pool.cache(0, b, 100 + b)
        pool.release(0, list(range(first, first + 4)))  # chunk c idle
        if c == 1:
            for _ in range(2):  # two hits on block 4: chunk 1 idle again, 2 chances
                pool.touch(0, [4])
                pool.release(0, [4])
    assert pool.allocate(1, 2) == [8, 9]  # chunk 4 was free
    pool.events.take()
    before = pool.snapshot()
    assert pool.fits([None, None], [None, None], [None, None], [0, 4])
    assert not pool.fits([None, None], [None, None], [None, None], [0, 7])
    assert pool.snapshot() == before
    # chunk 1 (oldest, holding chances) spends one and moves behind chunk 3: 2 and 3 go
    assert pool.allocate(1, 4) == [4, 5, 6, 7]
    evicted = [e.block_hashes for e in pool.events.take()]  # type: ignore[attr-defined]
    assert evicted == [(108, 109, 110, 111), (112, 113, 114, 115)]
    assert pool.chunk_owner(1) == 0 and pool.hit[0][4] == 1
    pool.check_invariants()
    # the last idle chunk spends its last chance, then goes all the same
    assert pool.allocate(1, 2) == [2, 3]
    evicted = [e.block_hashes for e in pool.events.take()]  # type: ignore[attr-defined]
    assert evicted == [(104, 105, 106, 107)] and pool.chunk_owner(1) == 1
    pool.check_invariants()


def test_a_spread_allocation_takes_whole_free_chunks_before_holes() -> None:
    # 512-byte chunks: 4 full-attention blocks or 2 sliding-window blocks; chunk 0 lends
    # ids 2..3 to group 0 (held), so group 1's chunk c holds ids 2c, 2c + 1.
    layout = arena(groups(full(), (swa(8), 8)), 6)
    for spread in (False, True):
        pool = make_block_pool(layout, EventLog(enabled=False))
        assert isinstance(pool, ArenaPool) and pool.blocks_per_chunk(1) == 2
        assert _hold_null_chunk(pool) == [2, 3]
        assert pool.allocate(1, 2) == [2, 3]  # chunk 1
        pool.release(1, [2])  # uncached: a free block (a hole) in chunk 1, still active
        assert pool.free_chunks == [5, 4, 3, 2]
        # group 1 spreading: 8 blocks = the 4 free chunks; 9 would evict; group 0 (no free
        # block) needs a chunk of its own for 1; not spreading, group 1's hole covers one
        assert pool.spreads([0, 8], {1: 8}) and not pool.spreads([0, 9], {1: 9})
        assert not pool.spreads([1, 8], {1: 8}) and pool.spreads([0, 9], {})
        # 8 of 9 spread: the hole takes the ninth; 8 of 10: the tenth needs a fifth chunk
        assert pool.spreads([0, 9], {1: 8}) and not pool.spreads([0, 10], {1: 8})
        before = pool.snapshot()
        assert pool.spreads([4, 2], {0: 4, 1: 2}) and pool.snapshot() == before  # a query
        if spread:
            # whole chunks first (2, then 3), the hole and chunk 3's other block left over
            assert pool.allocate_spread(1, 3) == [4, 5, 6]
            assert list(pool.free_uncached[1]) == [2, 7] and pool.free_chunks == [5, 4]
        else:
            assert pool.allocate(1, 3) == [2, 4, 5]  # the hole first, then chunk 2
            assert not pool.free_uncached[1] and pool.free_chunks == [5, 4, 3]
        pool.check_invariants()
    flat = make_block_pool(uniform(groups(full(), swa(8)), 6), EventLog(enabled=False))
    assert flat.blocks_per_chunk(1) == 1 and not flat.spreads([0, 1], {1: 1})
    assert flat.allocate_spread(1, 2) == [1, 2]  # no chunks: allocate as usual
    flat.check_invariants()


def test_windowed_groups_of_a_chunked_arena_spread() -> None:
    gs = groups(full(), (swa(8), 8), (chunked(8), 8))
    assert set(KVCacheManager(arena(gs, 6))._coord.spread.groups) == {1, 2}
    assert not KVCacheManager(uniform(groups(full(), swa(8)), 6))._coord.spread.groups
    assert not KVCacheManager(arena(groups(full(), swa(8)), 6, 1))._coord.spread.groups


def test_only_the_blocks_a_step_pushes_out_of_the_window_take_whole_chunks() -> None:
    # 512-byte chunks of 4 blocks for both groups; chunk 0 lends group 0 ids 1..3.  Window 8,
    # blocks of 4 tokens: a 32-token prompt takes 8 window blocks, the step's end (32)
    # keeps blocks 6 and 7 (first kept token 25), so blocks 0..5 are transient: 4 of them
    # (a whole chunk's worth) take a fresh chunk, the other 4 the group's free blocks first.
    layout = arena(groups(full(), swa(8)), 8, 4)
    manager = KVCacheManager(layout)
    pool = manager._coord.pool
    assert isinstance(pool, ArenaPool) and pool.free_chunks == [7, 6, 5, 4, 3, 2, 1]
    a = Request("a", list(range(100, 132)), hash_block_size=layout.hash_block_size)
    out = manager.allocate_slots(a, 32)
    assert out is not None
    # full attention: the loan's 1..3, chunk 1, then chunk 2's first block; the window: the
    # kept part carves chunk 3 (12..15), the transient part chunk 4 (16..19) in front of it
    assert out.new_block_ids == ((1, 2, 3, 4, 5, 6, 7, 8), (16, 17, 18, 19, 12, 13, 14, 15))
    assert pool.free_chunks == [7, 6, 5]
    a.num_computed_tokens = 32
    a.append_token_ids([7])
    out = manager.allocate_slots(a, 1)
    assert out is not None
    # blocks 0..5 leave the window: chunk 4 is free again as a whole, chunk 3 keeps 14, 15
    # and 13 (cached: the window before the prompt's end), and the decoded token's block
    # takes 12, a free block of chunk 3, not a fresh chunk (which the old rule carved for
    # every new window block while free chunks lasted, stranding them)
    assert out.new_block_ids == ((9,), (12,))
    assert pool.free_chunks == [7, 6, 5, 4]
    assert [pool.chunk_owner(c) for c in range(8)] == [0, 0, 0, 1, None, None, None, None]
    manager.check_invariants()


def test_one_group_flat_arena_counts_the_tail_as_its_last_ids() -> None:
    layout = arena(groups(full()), 3, tail=True)  # 256-byte chunks, 255 B past them
    assert layout.null_host == (0, 1, 2) and layout.tail_host == (0, 6, 7)
    pool = make_block_pool(layout, EventLog(enabled=False))
    assert isinstance(pool, FlatArenaPool)
    assert pool.num_free(0) == 6 and pool.allocate(0, 6) == [1, 2, 3, 4, 5, 6]
    assert [pool.chunk_owner(c) for c in range(4)] == [0, 0, 0, 0]
    with pytest.raises(LayoutMismatchError, match="chunk 4 is not a chunk"):
        pool.chunk_owner(4)
    assert pool.usage == 1.0
    pool.check_invariants()


def test_one_group_arena_is_flat_skips_the_null_block_and_evicts_per_block() -> None:
    # One group, 4 blocks per chunk, 3 chunks: id 0 is the null block (the group hosts the
    # rest of chunk 0), 1..11 usable.
    layout = arena(groups(full()), 3, blocks_per_chunk=4)
    pool = make_block_pool(layout, EventLog(enabled=True))
    assert isinstance(pool, FlatArenaPool)
    assert pool.num_free(0) == 11
    assert pool.allocate(0, 3) == [1, 2, 3]
    assert [pool.chunk_owner(c) for c in range(3)] == [0, None, None]
    assert pool.usage == pytest.approx(3 / 11)
    assert pool.used_bytes == 3 * layout.groups[0].block_bytes
    pool.cache(0, 1, 101)
    pool.cache(0, 2, 102)
    pool.release(0, [3, 2, 1])  # tail first: LRU = [2, 1]
    assert pool.chunk_owner(0) == 0  # cached blocks keep the chunk
    assert pool.allocate(0, 8) == [3, 4, 5, 6, 7, 8, 9, 10]
    assert pool.allocate(0, 2) == [11, 2]  # then the least recently used block, not a chunk
    assert pool.events.take() == [BlockRemoved(0, (102,))]  # type: ignore[arg-type]
    pool.check_invariants()
    with pytest.raises(LayoutMismatchError, match=r"arena; valid: \[0, 3\)"):
        pool.chunk_owner(3)


def test_equal_page_arena_is_flat_and_own_first_keeps_the_arena_pool() -> None:
    layout = arena(groups(full(), state()), 5, blocks_per_chunk=1)
    assert isinstance(make_block_pool(layout, EventLog(enabled=False)), FlatArenaPool)
    own = make_block_pool(layout, EventLog(enabled=False), arena_eviction="own_first")
    assert isinstance(own, ArenaPool)
    mixed = arena(groups(full(), (full(), 8)), 5)  # 128- and 256-byte blocks: real chunks
    assert isinstance(make_block_pool(mixed, EventLog(enabled=False)), ArenaPool)


@pytest.mark.skipif(compiled(), reason="deep-copies managers; compiled classes do not copy")
@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    window=st.sampled_from([swa(4), swa(8, sinks=2), chunked(8)]),
    per_chunk=st.sampled_from([2, 3, 4]),
    chunks=st.integers(8, 24),
    window_first=st.booleans(),
)
def test_spreading_never_changes_what_a_call_gets_or_evicts(
    seed: int, window: CacheSpec, per_chunk: int, chunks: int, window_first: bool
) -> None:
    """Before every allocation, a twin of the manager with spreading off makes the same call:
    both succeed or both refuse, and both leave the same cached blocks (a spread takes only
    whole free chunks, so it never evicts, and leaves the groups allocated after it the
    free blocks they would have had).  Random prompts sharing prefixes, hits, prefill
    chunks of 1-24 tokens, decodes and frees."""
    rng = random.Random(seed)
    order = ((window, 2), full()) if window_first else (full(), (window, 2))
    manager = KVCacheManager(arena(groups(*order), chunks, per_chunk))
    live: dict[str, Request] = {}
    for step in range(200):
        if live and rng.random() < 0.15:
            manager.free(live.pop(rng.choice(sorted(live))).request_id)
            continue
        kwargs: dict[str, Any] = {}
        if not live or rng.random() < 0.3:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(2, 60))]
            req = Request(f"r{step}", prompt, hash_block_size=manager.layout.hash_block_size)
            hit = manager.get_computed_blocks(req)
            kwargs = {"num_new_computed_tokens": hit.num_computed_tokens}
            kwargs["new_computed_blocks"] = hit
            done = hit.num_computed_tokens
        else:
            req = live[rng.choice(sorted(live))]
            if req.num_computed_tokens >= req.num_tokens:
                req.append_token_ids([rng.randrange(3)])
            done = req.num_computed_tokens
        n = min(rng.randrange(1, 25), req.num_tokens - done)
        twin, twin_req, twin_kwargs = copy.deepcopy((manager, req, kwargs))
        twin._coord.spread.groups = {}
        want = twin.allocate_slots(twin_req, n, **twin_kwargs)
        got = manager.allocate_slots(req, n, **kwargs)
        assert (got is None) == (want is None), step
        ours, theirs = manager._coord.pool, twin._coord.pool
        assert isinstance(ours, ArenaPool) and isinstance(theirs, ArenaPool)
        assert [set(m) for m in ours.maps] == [set(m) for m in theirs.maps], step
        manager.check_invariants()
        if got is not None:
            req.num_computed_tokens = done + n
            live[req.request_id] = req


def test_compaction_moves_a_sparse_chunks_blocks_and_keeps_the_youngest_cached() -> None:
    # Group 1 (2 blocks a chunk) holds one referenced block in each of chunks 1, 2 and 3;
    # its unreferenced slots (a hole in chunk 2, cached blocks in chunks 1 and 3) make one
    # chunk's worth, so one chunk can be emptied: chunk 1 (fewest references, lowest id).
    pool = make_block_pool(arena(groups(full(), (swa(8), 8)), 6), EventLog(enabled=True))
    assert isinstance(pool, ArenaPool) and pool.blocks_per_chunk(1) == 2
    _hold_null_chunk(pool)
    assert [pool.allocate(1, 2) for _ in range(3)] == [[2, 3], [4, 5], [6, 7]]
    pool.cache(1, 7, 77)
    pool.release(1, [7])  # cached in chunk 3, older
    pool.cache(1, 3, 33)
    pool.release(1, [3])  # cached in chunk 1 (the victim), younger
    pool.release(1, [5])  # a hole in chunk 2
    assert pool.free_chunks == [5, 4]
    before = pool.snapshot()
    assert pool.compact(1, frozenset({0})) == [] and pool.snapshot() == before  # not movable
    assert pool.compact(1, frozenset({0, 1}), {1, 2, 3}) == []  # every candidate fixed
    assert pool.snapshot() == before
    moves = pool.compact(1, frozenset({0, 1}))
    # One slot is left for cached data after the move: the younger (33) is kept and moves,
    # the older (77) is evicted to make room; the referenced block takes 77's slot first.
    assert moves == [(1, 2, 7), (1, 3, 5)]
    assert pool.maps[1] == {33: 5} and pool.refs[1][7] == 1 and pool.refs[1][2] == 0
    assert list(pool.free_cached[1]) == [5] and not pool.free_uncached[1]
    assert pool.free_chunks == [5, 4, 1] and pool.chunk_owner(1) is None
    assert pool.events.take() == [BlockRemoved(1, (77,))]
    pool.check_invariants()
    assert pool.compact(1, frozenset({0, 1})) == []  # no chunk's worth of slots left
    pool.check_invariants()


def test_compaction_evicts_as_the_lru_does_a_block_with_a_chance_spends_it() -> None:
    # The previous test's chunks, but the older cached block (77) served a hit since it was
    # cached: compaction's eviction spends its chance (it goes to the young end, as the LRU's
    # own eviction would) and evicts the younger 33 instead, in the emptied chunk; the
    # referenced block then takes the hole in chunk 2.
    pool = make_block_pool(arena(groups(full(), (swa(8), 8)), 6), EventLog(enabled=True))
    assert isinstance(pool, ArenaPool)
    _hold_null_chunk(pool)
    assert [pool.allocate(1, 2) for _ in range(3)] == [[2, 3], [4, 5], [6, 7]]
    pool.cache(1, 7, 77)
    pool.release(1, [7])
    pool.touch(1, [7])  # a hit: one chance
    pool.release(1, [7])  # cached in chunk 3, older, holding its chance
    pool.cache(1, 3, 33)
    pool.release(1, [3])  # cached in chunk 1 (the victim), younger
    pool.release(1, [5])  # a hole in chunk 2
    assert list(pool.free_cached[1]) == [7, 3] and pool.hit[1][7] == 1
    moves = pool.compact(1, frozenset({0, 1}))
    assert moves == [(1, 2, 5)]
    assert pool.maps[1] == {77: 7} and pool.hit[1][7] == 0
    assert list(pool.free_cached[1]) == [7] and pool.refs[1][5] == 1
    assert pool.free_chunks == [5, 4, 1]
    assert pool.events.take() == [BlockRemoved(1, (33,))]
    pool.check_invariants()


def _compactions_over_published_blocks(seed: int) -> int:
    """Random requests on an arena with a host tier (bookkeeping only) and write-through;
    every refused step compacts.  Returns how many compactions moved a block still waiting
    in the write-through list, each checked to name the block's new id there."""
    rng = random.Random(seed)
    layout = arena(groups(full(), (swa(8), 8)), 8)
    big = max(g.block_bytes for g in layout.groups)
    mgr = KVCacheManager(
        layout, hasher="builtin", tiers=[TierSpec("host", 64 * big)], tier_write_through="host"
    )
    bridge = mgr._coord.bridge
    assert bridge is not None
    live: dict[str, Request] = {}
    seen = 0
    for step in range(300):
        if live and rng.random() < 0.1:
            mgr.free(live.pop(rng.choice(sorted(live))).request_id)
            continue
        if rng.random() < 0.2:
            mgr.write_through()
        if not live or rng.random() < 0.3:
            prompt = [rng.randrange(3) for _ in range(rng.randrange(2, 60))]
            req = mgr.make_request(f"r{step}", prompt)
            hit = mgr.get_computed_blocks(req)
            n = min(rng.randrange(1, 25), req.num_tokens - hit.num_computed_tokens)
            done = hit.num_computed_tokens
            kw: dict[str, Any] = {"num_new_computed_tokens": done, "new_computed_blocks": hit}
            if mgr.allocate_slots(req, n, **kw) is not None:
                req.num_computed_tokens = done + n
                live[req.request_id] = req
            continue
        req = live[rng.choice(sorted(live))]
        if req.num_computed_tokens >= req.num_tokens:
            req.append_token_ids([rng.randrange(3)])
        n = min(rng.randrange(1, 25), req.num_tokens - req.num_computed_tokens)
        if mgr.allocate_slots(req, n) is not None:
            req.num_computed_tokens += n
            continue
        before = [(g, list(items)) for g, items in bridge.published]
        moves = mgr.compact(req, n)
        where = {(m.group_id, m.src): m.dst for m in moves}
        if any((g, b) in where for g, items in before for _, b, _ in items):
            seen += 1
        remapped = [(g, [(j, where.get((g, b), b), h) for j, b, h in items]) for g, items in before]
        assert bridge.published == remapped
        mgr.check_invariants()
    return seen


def test_compaction_with_bookkeeping_tiers_remaps_the_write_through_list() -> None:
    # Without a storage-operation stream (the simulator's tiers) compaction runs, and a block
    # published for write-through but not yet stored is stored from where it moved.
    assert [_compactions_over_published_blocks(s) for s in range(10)] == [
        2,
        1,
        0,
        2,
        0,
        0,
        0,
        0,
        1,
        1,
    ]
