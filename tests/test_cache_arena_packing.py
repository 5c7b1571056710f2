"""Fullest-chunk-first placement in the arena (:mod:`hybridkv.cache.arena_packing`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.cache.arena_packing import FillIndex, NoFill
from hybridkv.cache.events import EventLog
from hybridkv.cache.pool_arena import ArenaPool
from hybridkv.errors import InvariantError
from hybridkv.specs import DType, StateMixer, StateSpec, StateTensor
from test_cache_factories import arena, full, groups


def _big_state() -> StateSpec:
    """A 512-byte state slot: four 128-byte attention blocks (block size 4) per chunk."""
    tensor = StateTensor(name="ssm", shape=(256,), dtype=DType.FP16)
    return StateSpec(mixer=StateMixer.MAMBA2, tensors=(tensor,))


def _pool() -> ArenaPool:
    pool = ArenaPool(
        arena(groups(full(), _big_state()), 5, blocks_per_chunk=1), EventLog(enabled=False)
    )
    assert pool.bpc == [4, 1] and pool.chunk_bytes == 512
    assert pool.allocate(0, 3) == [1, 2, 3]  # chunk 0's loan past the null block, held
    return pool


def test_a_freed_slot_of_the_fullest_chunk_is_refilled_so_the_sparse_chunk_drains() -> None:
    pool = _pool()
    assert pool.allocate(0, 4) == [4, 5, 6, 7]  # chunk 1
    assert pool.allocate(0, 4) == [8, 9, 10, 11]  # chunk 2
    pool.release(0, [7])  # chunk 1: 3 referenced
    pool.release(0, [11, 10])  # chunk 2: 2 referenced, its slots freed last
    # The most recently freed slot would be 10 (chunk 2); the fullest chunk's is 7.
    assert pool.allocate(0, 1) == [7]
    pool.check_invariants()
    pool.release(0, [8, 9])  # chunk 2's last references: it returns to the arena
    assert pool.chunk_owner(2) is None and sorted(pool.free_chunks) == [2, 3, 4]
    nothing = [None, None]
    assert pool.fits(nothing, nothing, nothing, [0, 3])  # a state slot per free chunk
    assert pool.allocate(1, 3) == [2, 3, 4]
    pool.check_invariants()


def test_the_next_block_comes_from_the_chunk_with_most_references() -> None:
    pool = _pool()
    assert pool.allocate(0, 12) == list(range(4, 16))  # chunks 1, 2, 3
    pool.release(0, [4, 5, 6])  # chunk 1: 1 referenced
    pool.release(0, [13])  # chunk 3: 3 referenced
    pool.release(0, [8, 9])  # chunk 2: 2 referenced
    # fullest first (chunk 3), then chunk 2, then chunk 1; in a chunk, the slot freed last
    assert pool.allocate(0, 6) == [13, 9, 8, 6, 5, 4]
    assert [pool.chunk_refd[c] for c in (1, 2, 3)] == [4, 4, 4]
    pool.check_invariants()


def test_a_spread_allocation_still_fills_the_chunk_it_carved() -> None:
    pool = _pool()
    assert pool.allocate(0, 4) == [4, 5, 6, 7]  # chunk 1
    pool.release(0, [5])  # a hole in chunk 1 (3 referenced)
    # spreading: a whole free chunk before the hole, its blocks in order
    assert pool.allocate_spread(0, 3) == [8, 9, 10]
    assert list(pool.free_uncached[0]) == [5, 11]
    pool.check_invariants()


def test_only_layouts_with_a_whole_chunk_group_pack() -> None:
    assert _pool().packs
    # 4 and 2 blocks per chunk: no group needs a whole chunk, the block freed last goes first
    pool = ArenaPool(arena(groups(full(), (full(), 8)), 4), EventLog(enabled=False))
    assert not pool.packs and isinstance(pool.fill, NoFill)
    assert pool.allocate(0, 2) == [2, 3]  # chunk 0's loan
    assert pool.allocate(0, 8) == [4, 5, 6, 7, 8, 9, 10, 11]  # chunks 1 and 2
    pool.release(0, [5])  # chunk 1: 3 referenced
    pool.release(0, [9, 10])  # chunk 2: 2 referenced, freed last
    assert pool.allocate(0, 1) == [10]
    pool.check_invariants()
    with pytest.raises(InvariantError, match="does not pack"):
        pool.fill.take(0)


def test_fill_index_buckets_ties_and_check() -> None:
    refd = [0, 0, 0, 0]
    fill = FillIndex(4, [3], refd)
    refd[1] = 1
    fill.add_range(0, 1, range(5, 3, -1))  # chunk 1 (1 referenced): blocks 4, 5 free
    refd[2] = 1
    fill.add(0, 2, 6)  # chunk 2 (1 referenced), filed after chunk 1
    assert fill.at == [-1, 1, 1, -1]
    assert fill.take(0) == 4  # a tie: the chunk filed first, its last-added block first
    refd[1] = 2
    fill.moved(0, 1)
    assert fill.take(0) == 5  # chunk 1 is now the fullest; then it has no free block
    refd[1] = 3
    fill.moved(0, 1)  # not filed any more: nothing to move
    assert fill.at == [-1, -1, 1, -1]
    refd[2] = 0
    fill.moved(0, 2)  # the only filed chunk, now in bucket 0
    owner = [-1, 0, 0, -1]
    fill.check(owner, [{6: None}])
    assert fill.take(0) == 6 and fill.at == [-1] * 4
    with pytest.raises(InvariantError, match="no free uncached block"):
        fill.take(0)
    fill.add(0, 3, 9)
    with pytest.raises(InvariantError, match="differ from the free queue"):
        fill.check([-1, 0, 0, 0], [{}])
    refd[3] = 2  # changed without moved(): filed in the wrong bucket
    with pytest.raises(InvariantError, match="filed wrongly"):
        fill.check([-1, 0, 0, 0], [{9: None}])
    fill.clear(0, 3)
    fill.check([-1, 0, 0, 0], [{}])
    fill._mask[0] = 1  # a stale bit for an empty bucket
    with pytest.raises(InvariantError, match="mask bit"):
        fill.check([-1, 0, 0, 0], [{}])
    fill.add(0, 3, 9)
    fill.reset()
    assert fill.at == [-1] * 4 and fill.blocks == [[], [], [], []]


def test_among_equally_full_chunks_the_one_filed_first_goes_first() -> None:
    refd = [0, 1, 1]
    fill = FillIndex(3, [4], refd)
    fill.add(0, 1, 10)  # chunk 1 filed first
    fill.add(0, 2, 20)
    refd[1] = 2
    fill.moved(0, 1)
    refd[1] = 1
    fill.moved(0, 1)  # back at count 1, after chunk 2 in the bucket's own order
    fill.check([-1, 0, 0], [{10: None, 20: None}])
    assert fill.take(0) == 10  # still chunk 1: it has had a free block longest
    before = fill.snapshot()
    fill.check([-1, 0, 0], [{20: None}])
    assert fill.snapshot() == before  # check reads only
    fill.add(0, 1, 11)  # filed again: now the newest
    assert fill.take(0) == 20 and fill.take(0) == 11


@settings(max_examples=200, deadline=None)
@given(
    frees=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 7)), min_size=1, max_size=40),
    wants=st.lists(st.integers(1, 12), min_size=1, max_size=6),
)
def test_take_run_gives_what_single_takes_give(
    frees: list[tuple[int, int]], wants: list[int]
) -> None:
    """``take_run`` (the arena's step 1 in one call) against ``take`` block by block, each
    followed by the count raise the pool makes: the same blocks in the same order, and the
    same filing after every call."""
    bpc = 8

    def build() -> tuple[FillIndex, list[int]]:
        refd = [bpc] * 6  # every chunk full, then some of its slots freed
        fill = FillIndex(6, [bpc], refd)
        freed: set[tuple[int, int]] = set()
        for c, slot in frees:
            if (c, slot) in freed:
                continue
            freed.add((c, slot))
            refd[c] -= 1
            fill.moved(0, c)
            fill.add(0, c, c * bpc + slot)
        return fill, refd

    one, refd_one = build()
    run, refd_run = build()
    for want in wants:
        singles: list[int] = []
        while len(singles) < want and one._mask[0]:
            b = one.take(0)
            refd_one[b // bpc] += 1
            singles.append(b)
        runs: list[int] = []
        while len(runs) < want and run._mask[0]:
            got = run.take_run(0, want - len(runs))
            assert len({b // bpc for b in got}) == 1  # one chunk per run
            refd_run[got[0] // bpc] += len(got)
            runs += got
        assert runs == singles
        assert refd_run == refd_one and run.at == one.at and run.blocks == one.blocks
        owner = [0] * 6
        free = {b for stack in one.blocks for b in stack}
        one.check(owner, [dict.fromkeys(free)])
        run.check(owner, [dict.fromkeys(free)])
