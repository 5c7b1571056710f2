"""Block pools: allocation order, LRU eviction, hit chances per group, per-group pools, and
exact feasibility checks; the arena's chunk mechanics are in test_cache_pools_arena.py."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given
from hypothesis import strategies as hst

from hybridkv.cache import KVCacheManager, compiled
from hybridkv.cache.events import BlockRemoved, EventLog
from hybridkv.cache.pool_arena import ArenaPool
from hybridkv.cache.pool_base import DEFAULT_WINDOW_CHANCES, BlockPool, group_chances
from hybridkv.cache.pool_freelist import FreeListPool
from hybridkv.cache.pools import make_block_pool
from hybridkv.errors import InvariantError, PlanError
from test_cache_factories import (
    STRATEGIES,
    arena,
    chunked,
    eviction_for,
    full,
    groups,
    layout_for,
    pools,
    spec_items,
    state,
    swa,
    uniform,
)


def test_uniform_reuses_uncached_first_then_evicts_least_recent() -> None:
    pool = make_block_pool(uniform(groups(full(), full()), 8), EventLog(enabled=True))
    assert pool.allocate(0, 3) == [1, 2, 3]
    assert pool.allocate(1, 2) == [4, 5]
    pool.cache(0, 1, 101)
    pool.cache(0, 2, 102)
    pool.release(0, [3, 2, 1])  # tail first: LRU = [2, 1]; block 3 is uncached
    assert pool.num_free(0) == 5 and pool.usage == pytest.approx(2 / 7)
    assert pool.used_bytes == 2 * pool.block_bytes  # type: ignore[attr-defined]
    assert pool.allocate(1, 3) == [3, 6, 7]  # uncached first, the last freed first
    assert pool.allocate(1, 1) == [2]  # then the least recently used cached block
    assert pool.events.take() == [BlockRemoved(0, (102,))]  # type: ignore[arg-type]
    assert pool.maps[0] == {101: 1}
    pool.touch(0, [1])  # a hit revives block 1
    assert pool.refs[0][1] == 1 and pool.num_free(0) == 0
    assert pool.is_allocated(0, 1) and not pool.is_allocated(1, 1)
    pool.check_invariants()


def test_a_huge_uniform_pool_costs_nothing_per_block_until_used() -> None:
    """Never-used ids are handed out in order after the freed ones, without a free-list entry
    each (a 2 TiB upper-bound run has millions of blocks), and per-group counts are kept as
    blocks are referenced, not counted over the pool."""
    n = 10_000_000
    pool = make_block_pool(uniform(groups(full(), full()), n), EventLog(enabled=True))
    core = pool.core  # type: ignore[attr-defined]
    assert core.free_uncached == {} and pool.num_free(0) == n - 1
    assert pool.allocate(0, 3) == [1, 2, 3] and pool.allocate(1, 2) == [4, 5]
    pool.release(0, [2])  # uncached: freed, so it comes back before the never-used ids
    assert pool.allocate(1, 2) == [2, 6]
    assert pool.used_per_group() == [2, 4] and pool.num_free(0) == n - 1 - 6
    pool.cache(0, 1, 11)
    pool.release(0, [1, 3])
    assert pool.used_per_group() == [0, 4]
    pool.touch(0, [1])  # a hit revives the cached block
    assert pool.used_per_group() == [1, 4] and list(core.free_uncached) == [3]


def test_a_block_that_served_a_hit_gets_one_second_chance() -> None:
    for chance in (True, False):
        pool = make_block_pool(
            uniform(groups(full()), 5), EventLog(enabled=True), second_chance=chance
        )
        assert pool.allocate(0, 4) == [1, 2, 3, 4]
        for b in (1, 2, 3, 4):
            pool.cache(0, b, 100 + b)
        pool.release(0, [1, 2, 3, 4])  # LRU: 1, 2, 3, 4
        pool.touch(0, [1])  # a hit on 1 (say, a shared system prompt)
        pool.release(0, [1])  # LRU: 2, 3, 4, 1
        pool.touch(0, [2])  # hits on 2 while it is the oldest
        pool.release(0, [2])  # LRU: 3, 4, 1, 2
        pool.refresh(0, [3])  # a refresh is no hit: LRU 4, 1, 2, 3
        pool.check_invariants()
        taken = pool.allocate(0, 3)
        evicted = [e.block_hashes[0] for e in pool.events.take()]  # type: ignore[attr-defined]
        if chance:
            # 4 goes; 1 and 2 served hits: each moves to the young end once (LRU 3, 1, 2),
            # then 3 and 1 go; 2 stays cached
            assert taken == [4, 3, 1] and evicted == [104, 103, 101]
            assert pool.maps[0] == {102: 2}
        else:
            assert taken == [4, 1, 2] and evicted == [104, 101, 102]
            assert pool.maps[0] == {103: 3}
        pool.check_invariants()
        before = pool.snapshot()
        assert pool.reset_cache() is False and pool.snapshot() == before


def test_each_hit_gives_a_block_a_chance_up_to_the_pool_s_count() -> None:
    # second_chance=2: a block that served two hits survives two sweeps, one that served one
    # survives one; a third hit adds nothing.
    pool = make_block_pool(uniform(groups(full()), 6), EventLog(enabled=True), second_chance=2)
    assert pool.allocate(0, 5) == [1, 2, 3, 4, 5]
    for b in (1, 2, 3, 4, 5):
        pool.cache(0, b, 100 + b)
    pool.release(0, [1, 2, 3, 4, 5])  # LRU: 1 2 3 4 5
    for _ in range(3):  # three hits on 1: two chances held, the third adds none
        pool.touch(0, [1])
        pool.release(0, [1])  # LRU: 2 3 4 5 1
    pool.touch(0, [2])  # one hit on 2
    pool.release(0, [2])  # LRU: 3 4 5 1 2
    pool.check_invariants()
    # 3, 4, 5 go; 1 spends a chance (LRU: 2 1), 2 spends its only one (LRU: 1 2), 1 spends
    # its last (LRU: 2 1), then 2 goes and 1 stays.
    assert pool.allocate(0, 4) == [3, 4, 5, 2]
    evicted = [e.block_hashes[0] for e in pool.events.take()]  # type: ignore[attr-defined]
    assert evicted == [103, 104, 105, 102]
    assert pool.maps[0] == {101: 1}
    pool.check_invariants()


def test_windowed_groups_hold_more_chances_than_the_others() -> None:
    # Groups full, sliding window, local chunks, state: windows take max(second_chance, 2).
    layout = uniform(groups(full(), swa(8), chunked(8), state()), 4)
    assert DEFAULT_WINDOW_CHANCES == 2
    assert group_chances(layout, 1) == [1, 2, 2, 1]
    assert group_chances(layout, 3) == [3, 3, 3, 3]
    assert group_chances(layout, 0) == [0, 0, 0, 0]
    assert group_chances(layout, 1, 5) == [1, 5, 5, 1]
    assert group_chances(layout, 0, 2) == [0, 2, 2, 0]
    with pytest.raises(PlanError, match=r"window_chances: 256 is not a chance count"):
        group_chances(layout, 1, 256)


@pytest.mark.parametrize("window", [None, 1, 0])
def test_a_window_block_with_two_hits_outlives_a_full_block_with_two(window: int | None) -> None:
    # Block 1 (full attention) and block 3 (sliding window) each serve two hits; 3 is older.
    pool = make_block_pool(
        uniform(groups(full(), swa(8)), 6),
        EventLog(enabled=True),
        window_chances=window,
    )
    assert pool.allocate(0, 2) == [1, 2] and pool.allocate(1, 3) == [3, 4, 5]
    for g, b in ((0, 1), (0, 2), (1, 3), (1, 4), (1, 5)):
        pool.cache(g, b, 100 + b)
    pool.release(0, [1, 2])
    pool.release(1, [3, 4, 5])  # LRU: 1 2 3 4 5
    for g, b in ((1, 3), (1, 3), (0, 1), (0, 1)):
        pool.touch(g, [b])
        pool.release(g, [b])  # LRU: 2 4 5 3 1
    pool.check_invariants()
    assert pool.allocate(0, 4)[:3] == [2, 4, 5]
    evicted = [e.block_hashes[0] for e in pool.events.take()]  # type: ignore[attr-defined]
    if window is None:
        # 3 holds two chances, 1 one: 3 spends (LRU 1 3), 1 spends (3 1), 3 spends, 1 goes
        assert evicted == [102, 104, 105, 101] and pool.maps[1] == {103: 3}
    elif window == 1:
        # one chance each: 3 spends (1 3), 1 spends (3 1), then 3 goes
        assert evicted == [102, 104, 105, 103] and pool.maps[0] == {101: 1}
    else:
        # no chance for the window block: it is the oldest once 2, 4, 5 are gone
        assert evicted == [102, 104, 105, 103] and pool.maps[0] == {101: 1}
    pool.check_invariants()


def test_every_pool_takes_the_per_group_caps() -> None:
    gs = groups(full(), (swa(8), 8))
    for layout in (uniform(groups(full(), swa(8)), 4), arena(gs, 5), pools(gs, 4)):
        pool = make_block_pool(layout, EventLog(enabled=False), second_chance=1)
        caps = [c.chances for c in pool.cores] if hasattr(pool, "cores") else pool.caps
        assert caps == [1, 2], type(pool).__name__
    pool = make_block_pool(uniform(groups(full(), swa(8)), 4), EventLog(enabled=False))
    b = pool.allocate(0, 1)[0]
    pool.core.hit[b] = 2  # a full-attention block holding a window's count
    with pytest.raises(InvariantError, match="more than 1"):
        pool.check_invariants()
    pool = make_block_pool(arena(gs, 5), EventLog(enabled=False))
    assert isinstance(pool, ArenaPool)
    pool.hit[0][2] = 2
    with pytest.raises(InvariantError, match="group 0: a block holds more than 1 chances"):
        pool.check_invariants()


def test_window_chances_out_of_range_is_refused() -> None:
    layout = uniform(groups(full(), swa(8)), 4)
    wrong = TypeError if compiled() else PlanError
    with pytest.raises(PlanError, match=r"window_chances: -1 is not a chance count"):
        KVCacheManager(layout, window_chances=-1)
    with pytest.raises(wrong):
        KVCacheManager(layout, window_chances="2")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 256, 1.5, "2"])
def test_a_chance_count_out_of_range_is_refused(bad: object) -> None:
    # The compiled build (mypyc) refuses a value of another type at the call: a TypeError.
    wrong_type = compiled() and not isinstance(bad, int)
    message = "int object expected" if wrong_type else r"second_chance: .* \[0, 255\]"
    refused = TypeError if wrong_type else PlanError
    for layout in (uniform(groups(full()), 4), arena(groups(full(), (full(), 8)), 4)):
        with pytest.raises(refused, match=message):
            KVCacheManager(layout, second_chance=bad)  # type: ignore[arg-type]
        with pytest.raises(refused, match=message):
            make_block_pool(layout, EventLog(enabled=False), second_chance=bad)  # type: ignore[arg-type]


def test_pools_evict_only_within_their_group() -> None:
    pool = make_block_pool(pools(groups(full(), full()), 3), EventLog(enabled=False))
    assert pool.allocate(0, 2) == [1, 2] and pool.allocate(1, 2) == [1, 2]
    pool.cache(1, 1, 7)
    pool.release(1, [1])
    assert pool.num_free(0) == 0 and pool.num_free(1) == 1
    assert not pool.fits([None, None], [None, None], [None, None], [1, 0])
    assert pool.fits([None, None], [None, None], [None, None], [0, 1])
    assert pool.allocate(1, 1) == [1] and pool.maps[1] == {}
    assert pool.used_bytes == 4 * pool.block_bytes[0]  # type: ignore[index]
    pool.check_invariants()


def _apply(
    pool: BlockPool,
    cached: list[dict[int, int]],
    releases: list[list[int]],
    touches: list[list[int]],
    needs: list[int],
) -> list[list[int]]:
    for g, items in enumerate(cached):
        for b, h in items.items():
            pool.cache(g, b, h)
    for g, rel in enumerate(releases):
        pool.release(g, rel)
    for g, tch in enumerate(touches):
        pool.touch(g, tch)
    return [pool.allocate(g, n) if n else [] for g, n in enumerate(needs)]


@pytest.mark.skipif(compiled(), reason="deep-copies pools; compiled classes do not copy")
@given(
    strategy=hst.sampled_from(STRATEGIES),
    items=hst.lists(spec_items(), min_size=1, max_size=3),
    capacity=hst.integers(2, 8),
    data=hst.data(),
)
def test_fits_is_exact(strategy: str, items: list, capacity: int, data: hst.DataObject) -> None:
    """fits() predicts exactly whether releasing, touching, then allocating succeeds."""
    layout = layout_for(strategy, groups(*items), capacity)
    pool = make_block_pool(layout, EventLog(enabled=False), arena_eviction=eviction_for(strategy))
    num_groups = len(items)
    held: list[list[int]] = [[] for _ in range(num_groups)]  # one entry per reference
    next_hash = 1
    for _ in range(data.draw(hst.integers(1, 12), label="steps")):
        releases: list[list[int]] = []
        cached: list[dict[int, int]] = []
        touches: list[list[int]] = []
        for g in range(num_groups):
            distinct = sorted(set(held[g]))
            rel = (
                data.draw(hst.lists(hst.sampled_from(distinct), unique=True), label="rel")
                if distinct
                else []
            )
            releases.append(rel)
            to_cache = {}
            for b in rel:
                if pool.hashes[g][b] is None and data.draw(hst.booleans(), label="cache"):
                    to_cache[b] = next_hash
                    next_hash += 1
            cached.append(to_cache)
            free_cached = sorted(b for b in pool.maps[g].values() if not pool.refs[g][b])
            touches.append(
                data.draw(hst.lists(hst.sampled_from(free_cached), unique=True), label="touch")
                if free_cached
                else []
            )
        needs = [data.draw(hst.integers(0, 6), label="need") for _ in range(num_groups)]
        predicted = pool.fits([set(c) for c in cached], releases, touches, needs)
        trial = copy.deepcopy(pool)
        try:
            new = _apply(trial, cached, releases, touches, needs)
            ok = True
        except (InvariantError, AssertionError, KeyError):
            ok = False
        assert predicted == ok
        if not ok:
            continue
        pool = trial
        pool.check_invariants()
        for g in range(num_groups):
            for b in releases[g]:
                held[g].remove(b)
            held[g] += touches[g] + new[g]
            for b in (
                data.draw(hst.lists(hst.sampled_from(held[g]), unique=True), label="pub")
                if held[g]
                else []
            ):
                if pool.hashes[g][b] is None:
                    pool.cache(g, b, next_hash)
                    next_hash += 1
        pool.check_invariants()
        used = [len(set(h)) for h in held]
        assert [pool.num_used(g) for g in range(num_groups)] == pool.used_per_group() == used


def test_two_q_keeps_blocks_used_once_on_probation() -> None:
    """2Q: blocks released for the first time wait on probation (FIFO) and go first; a block
    that served a hit, or whose data was evicted and came back (its key in the ghost list),
    joins the main LRU."""
    pool = make_block_pool(uniform(groups(full()), 7), EventLog(enabled=True), eviction="2q")
    assert pool.allocate(0, 5) == [1, 2, 3, 4, 5]
    for b in (1, 2, 3, 4, 5):
        pool.cache(0, b, 100 + b)
    pool.release(0, [1, 2, 3, 4, 5])  # probation: 1 2 3 4 5
    pool.touch(0, [1])  # a hit: 1 is proven (and holds a chance)
    pool.release(0, [1])  # main: 1; probation: 2 3 4 5
    pool.check_invariants()
    # the never-used block 6 first, then probation's oldest: 2 and 3 (their keys join the ghost)
    assert pool.allocate(0, 3) == [6, 2, 3]
    evicted = [e.block_hashes[0] for e in pool.events.take()]  # type: ignore[attr-defined]
    assert evicted == [102, 103]
    pool.cache(0, 2, 102)  # the data of 102 came back, computed again
    pool.release(0, [2])  # its key was in the ghost list: main 1 2; probation 4 5
    pool.check_invariants()
    assert pool.allocate(0, 2) == [4, 5]  # probation goes first while it holds more than 10%
    pool.check_invariants()
    # probation is empty: the main LRU, where 1 spends its chance and 2 goes
    assert pool.allocate(0, 1) == [2]
    evicted = [e.block_hashes[0] for e in pool.events.take()]  # type: ignore[attr-defined]
    assert evicted == [104, 105, 102]
    assert pool.maps[0] == {101: 1}
    pool.check_invariants()
    before = pool.snapshot()
    assert pool.reset_cache() is False and pool.snapshot() == before


def test_two_q_ghost_keeps_the_youngest_evictions_and_a_key_evicted_again_is_young() -> None:
    """The ghost list holds the last ``ghost_cap`` evicted keys: a key evicted a second time
    moves to the young end, so the oldest other key leaves first."""
    pool = make_block_pool(uniform(groups(full()), 4), EventLog(enabled=False), eviction="2q")
    core = pool.core  # type: ignore[attr-defined]
    assert isinstance(core, FreeListPool) and core.ghost is not None
    core.ghost_cap = 2

    def cycle(h: int) -> None:  # cache h on a fresh or evicted block, release, evict it
        (b,) = pool.allocate(0, 1)
        pool.cache(0, b, h)
        pool.release(0, [b])

    for h in (10, 11, 12):
        cycle(h)  # blocks 1, 2, 3 on probation: 10 11 12
    assert pool.allocate(0, 2) == [1, 2]  # 10 and 11 evicted
    assert list(core.ghost) == [10, 11]
    pool.cache(0, 1, 10)  # 10 computed again: back from the ghost list, proven
    pool.release(0, [1])
    pool.release(0, [2])  # uncached: free
    pool.touch(0, [3])  # 12 proven too
    pool.release(0, [3])
    assert pool.allocate(0, 1) == [2]
    assert pool.allocate(0, 2) == [1, 3]  # main LRU: 10, then 12
    assert list(core.ghost) == [10, 12]  # 10 young again, 11 the oldest: dropped
    pool.check_invariants()


def test_the_eviction_order_is_checked() -> None:
    """An unknown order, and 2Q on the chunked arena (its chunks keep their own order), are
    refused by name; the flat arena and per-group pools run it."""
    with pytest.raises(PlanError, match="eviction: 'mru' is not an eviction order; valid: lru, 2q"):
        KVCacheManager(uniform(groups(full()), 7), eviction="mru")
    chunked_arena = arena(groups(full(), state()), 8)
    with pytest.raises(PlanError, match="eviction: '2q' runs on free-list pools"):
        KVCacheManager(chunked_arena, eviction="2q")
    KVCacheManager(pools(groups(full(), swa(4)), 8), eviction="2q").check_invariants()
