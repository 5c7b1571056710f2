"""A state checkpoint stored in parts (one slot per state group) leaves the cache whole:
``BlockPool.uncache`` on every pool, the coordinator's sweep after an eviction, and the
admission counting a checkpoint once."""

from __future__ import annotations

import pytest

from hybridkv.cache import KVCacheManager, Request
from hybridkv.cache.events import BlockRemoved, EventLog
from hybridkv.cache.pool_arena import ArenaPool
from hybridkv.cache.pools import make_block_pool
from hybridkv.errors import InvariantError
from hybridkv.specs import CacheKind
from test_cache_factories import (
    admit,
    arena,
    full,
    groups,
    pools,
    state,
    step,
    tokens,
    uniform,
)

H = 0xABC


@pytest.mark.parametrize("layout_of", [uniform, pools])
def test_free_list_pools_uncache_free_cached_blocks_only(layout_of: object) -> None:
    layout = layout_of(groups(full(), state()), 4)  # type: ignore[operator]
    events = EventLog(enabled=True)
    pool = make_block_pool(layout, events, second_chance=1)
    [a, b] = pool.allocate(1, 2)
    pool.cache(1, a, H)
    pool.cache(1, b, H + 1)
    pool.touch(1, [a])  # a hit: a holds a chance now
    pool.release(1, [a, a, b])  # both free and cached
    pool.touch(1, [b])  # b is referenced again (a hit)
    assert pool.uncache(1, [a, b, 3]) == 1  # b is referenced, 3 was never cached
    assert pool.maps[1] == {H + 1: b} and pool.hashes[1][a] is None
    assert events.take() == [BlockRemoved(1, (H,))]
    pool.check_invariants()
    # The dropped block is reused before anything cached, and holds no chance any more.
    assert pool.allocate(1, 1) == [a]
    pool.check_invariants()


def test_arena_uncache_in_an_active_chunk_queues_the_block_uncached() -> None:
    pool = ArenaPool(arena(groups(state(), state()), 4), EventLog(enabled=True))
    [a, _] = pool.allocate(1, 2)  # one chunk of two slots
    chunk = pool.chunk_owner(1)
    assert chunk == 1
    pool.cache(1, a, H)
    pool.release(1, [a])  # the chunk stays active: b is referenced
    assert list(pool.free_cached[1]) == [a]
    assert pool.uncache(1, [a]) == 1
    assert list(pool.free_cached[1]) == [] and a in pool.free_uncached[1]
    assert pool.maps[1] == {} and pool.chunk_cached_free[1] == 0
    assert pool.events.take() == [BlockRemoved(1, (H,))]
    pool.check_invariants()


def test_arena_uncache_of_an_idle_chunk_s_last_entry_frees_the_chunk() -> None:
    pool = ArenaPool(arena(groups(state(), state()), 4), EventLog(enabled=False))
    [a, b] = pool.allocate(1, 2)
    pool.cache(1, a, H)
    pool.cache(1, b, H + 1)
    pool.release(1, [a, b])  # idle: no reference, two cached blocks
    assert pool.chunk_owner(1) == 1 and 1 in pool.idle_all
    assert pool.uncache(1, [b]) == 1  # one left: still idle, still group 1's
    assert pool.chunk_owner(1) == 1 and 1 in pool.idle_all
    pool.check_invariants()
    assert pool.uncache(1, [a]) == 1  # nothing cached left: the chunk is free for anyone
    assert pool.chunk_owner(1) is None and 1 in pool.free_chunks and not pool.idle_all
    pool.check_invariants()
    # Group 0 takes chunk 0's spare id (it hosts the null chunk), then carves chunk 1.
    assert pool.allocate(0, 2) == [1, 2]
    assert pool.chunk_owner(1) == 0


def _split_manager(layout_of: object, sizes: object) -> KVCacheManager:
    """Full attention plus two state groups (a state group split in two), block size 4."""
    layout = layout_of(groups(full(), state(), state()), sizes)  # type: ignore[operator]
    return KVCacheManager(
        layout, hasher="builtin", enable_kv_events=True, checkpoint_admission="all"
    )


def _checkpoint_at_8(mgr: KVCacheManager, rid: str, start: int) -> Request:
    """A 9-token prompt prefilled 8 + 1 (a checkpoint at 8 in both state groups), freed."""
    req = mgr.make_request(rid, tokens(9, start))
    _, res = admit(mgr, req, budget=8)
    assert res is not None
    step(req, 8)
    assert mgr.allocate_slots(req, 1) is not None
    step(req, 1)
    mgr.free(rid)
    return req


def test_evicting_one_part_drops_the_other_parts() -> None:
    # pools: state group 1 has 2 slots, group 2 has 3.  The first request leaves a checkpoint
    # at 8 in both; the second (other tokens) needs a running slot and a checkpoint slot in
    # each group: group 1 must evict its part, group 2 has free slots.  The sweep drops
    # group 2's part too, so neither group caches it and group 2's slot is free, uncached.
    mgr = _split_manager(pools, [8, 3, 4])
    first = _checkpoint_at_8(mgr, "a", 0)
    h8 = first.block_hashes[1]
    maps = mgr._coord.pool.maps
    assert h8 in maps[1] and h8 in maps[2]
    part = maps[2][h8]
    mgr.take_events()
    other = mgr.make_request("b", tokens(9, 100))
    _, res = admit(mgr, other, budget=8)
    assert res is not None
    assert h8 not in maps[1] and h8 not in maps[2]
    removed = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved(1, (h8,)), BlockRemoved(2, (h8,))]
    core = mgr._coord.pool.cores[2]  # type: ignore[attr-defined]
    assert part in core.free_uncached
    mgr.check_invariants()
    # The full-attention prefix is still cached, but no hit can restore a state at 8 now.
    again = mgr.make_request("c", tokens(9, 0))
    assert mgr.get_computed_blocks(again).num_computed_tokens == 0


@pytest.mark.parametrize("layout_of", [uniform, arena])
def test_a_whole_checkpoint_survives_or_goes_in_shared_pools(layout_of: object) -> None:
    # Shared memory (one LRU): requests with distinct prompts keep evicting; after every call
    # both state groups cache exactly the same checkpoints, and a checkpoint still cached in
    # both serves a hit.
    mgr = _split_manager(layout_of, 10)
    seen = []
    for i in range(6):
        req = _checkpoint_at_8(mgr, f"r{i}", 1000 * i)
        seen.append(req.block_hashes[1])
        mgr.check_invariants()
        maps = mgr._coord.pool.maps
        assert maps[1].keys() == maps[2].keys()
    maps = mgr._coord.pool.maps
    kept = [i for i, h in enumerate(seen) if h in maps[1]]
    assert kept and kept[-1] == 5  # the newest is cached
    hit = mgr.get_computed_blocks(mgr.make_request("x", tokens(9, 5000)))
    assert hit.num_computed_tokens == 8


def test_the_sweep_is_checked_by_the_invariants() -> None:
    mgr = _split_manager(uniform, 10)
    _checkpoint_at_8(mgr, "a", 0)
    pool = mgr._coord.pool
    [(h, b)] = list(pool.maps[2].items())
    pool.uncache(2, [b])  # by hand: group 1's part is now alone, and the note unswept
    with pytest.raises(InvariantError, match="never swept"):
        mgr.check_invariants()
    mgr._coord.events.orphaned.clear()
    with pytest.raises(InvariantError, match=r"state group 2 .* lacks some it holds"):
        mgr.check_invariants()
    assert h in pool.maps[1]


def test_a_checkpoint_in_parts_is_credited_once() -> None:
    mgr = KVCacheManager(
        uniform(groups(full(), state(), state()), 9), hasher="builtin", checkpoint_admission="yield"
    )
    adm = mgr._coord.admission
    assert adm is not None
    state_groups = [m for m in mgr._coord.managers if m.spec.kind is CacheKind.STATE]
    assert [m.credits for m in state_groups] == [True, False]
    _checkpoint_at_8(mgr, "a", 0)
    published = [r for r, c in enumerate(adm.checkpoints) if c]
    assert len(published) == 1 and adm.checkpoints[published[0]] == 1  # one, not two
    assert adm.checkpoint_bytes[published[0]] == 2 * state_groups[0].block_bytes  # both parts
    req = mgr.make_request("b", tokens(9, 0))
    _, res = admit(mgr, req)
    assert res is not None and req.num_computed_tokens == 8
    assert adm.hit_tokens[published[0]] == 8  # once, not twice
