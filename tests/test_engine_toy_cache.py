"""The reference allocator that drives the runner in tests: exact ids, recycling, sharing."""

from __future__ import annotations

import re

import pytest

from hybridkv.engine.batch import SlotCopy, StateIO
from hybridkv.errors import AllocationError, RequestError
from hybridkv.plan import ArenaPlan, GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.specs import (
    CacheSpec,
    FullAttentionSpec,
    SlidingWindowSpec,
    StateMixer,
    StateSpec,
    StateTensor,
)

from support.toy_cache import ToyCache

FULL = FullAttentionSpec(num_kv_heads=1, head_dim=2, dtype="fp32")
SLIDING = SlidingWindowSpec(num_kv_heads=1, head_dim=2, dtype="fp32", window=4)
STATE = StateSpec(
    mixer=StateMixer.SHORT_CONV, tensors=(StateTensor(name="conv", shape=(2, 3), dtype="fp32"),)
)


def groups(*specs: CacheSpec) -> tuple[GroupPlan, ...]:
    return tuple(
        GroupPlan(
            group_id=i,
            spec=s,
            members=((i, 0),),
            block_size=4,
            kernel_block_size=4,
            page_bytes=s.bytes_per_block(4),
        )
        for i, s in enumerate(specs)
    )


def pools_layout(num_blocks: int = 8) -> MemoryLayout:
    gs = groups(FULL, SLIDING, STATE)
    pools = tuple(
        PoolPlan(
            pool_id=g.group_id,
            group_ids=(g.group_id,),
            block_bytes=g.block_bytes,
            num_blocks=num_blocks,
        )
        for g in gs
    )
    return MemoryLayout(strategy=Strategy.POOLS, groups=gs, pools=pools)


def test_schedule_commit_recycle_checkpoint_and_share() -> None:
    cache = ToyCache(pools_layout())
    assert cache.add("a") == 0
    s1 = cache.schedule("a", [1, 2, 3, 4, 5, 6])
    assert dict(s1.block_tables) == {0: (1, 2), 1: (1, 2)}
    assert s1.states[2] == StateIO(read_slot=None, write_slot=1)
    cache.commit(s1)
    assert cache.block_table("a", 1) == (1, 2)  # window 4 at 6 tokens reads 3..5: block 0 kept
    s2 = cache.schedule("a", [7, 8])
    # ends on a block boundary: the running state is checkpointed into slot 2 after the step
    assert s2.states[2] == StateIO(
        read_slot=1, write_slot=1, copies_after=(SlotCopy(src=1, dst=2),)
    )
    cache.commit(s2)
    assert cache.block_table("a", 1) == (0, 2)  # tokens 0..3 left the window
    assert cache.released == 1 and cache.checkpoint_slot("a", 2, 8) == 2
    cache.check_invariants()

    assert cache.add("b", prefix_of="a", prefix_len=8) == 8
    assert cache.block_table("b", 0) == (1, 2)  # the same blocks: shared, not copied
    assert cache.block_table("b", 1) == (0, 2)
    s3 = cache.schedule("b", [9])
    # the sliding group reuses block 1, which a released: lowest free id first
    assert dict(s3.block_tables) == {0: (1, 2, 3), 1: (0, 2, 1)}
    assert s3.states[2] == StateIO(read_slot=2, write_slot=3)  # restore a's checkpoint
    cache.commit(s3)
    cache.free("a")
    cache.check_invariants()
    # b still holds the shared blocks; a's running slot 1 and checkpoint 2 went back
    assert cache.num_free(0) == 7 - 3 and cache.num_free(2) == 7 - 1
    cache.free("b")
    cache.check_invariants()
    assert [cache.num_free(g) for g in range(3)] == [7, 7, 7]


def test_groups_of_one_pool_share_ids() -> None:
    gs = groups(FULL, SLIDING)
    pool = PoolPlan(pool_id=0, group_ids=(0, 1), block_bytes=gs[0].block_bytes, num_blocks=8)
    cache = ToyCache(MemoryLayout(strategy=Strategy.UNIFORM, groups=gs, pools=(pool,)))
    cache.add("a")
    s = cache.schedule("a", list(range(5)))
    assert dict(s.block_tables) == {0: (1, 2), 1: (3, 4)}
    assert cache.num_free(0) == cache.num_free(1) == 3
    cache.check_invariants()


def test_arena_groups_carve_whole_chunks() -> None:
    gs = groups(FULL, SLIDING)
    layout = MemoryLayout(
        strategy=Strategy.ARENA,
        groups=gs,
        arena=ArenaPlan(chunk_bytes=gs[0].block_bytes * 2, num_chunks=5),
    )
    cache = ToyCache(layout)
    cache.add("a")
    s = cache.schedule("a", list(range(9)))
    # group 0 takes chunks 1 (ids 2, 3) and 2 (4, 5); group 1 takes chunks 3 and 4 (6..9)
    assert dict(s.block_tables) == {0: (2, 3, 4), 1: (6, 7, 8)}
    assert cache.num_free(0) == 1 and cache.num_free(1) == 1
    cache.commit(s)
    with pytest.raises(AllocationError, match="group 0 has no free block left"):
        cache.schedule("a", list(range(9, 17)))
    cache.check_invariants()


def test_allocation_failure_keeps_nothing() -> None:
    cache = ToyCache(pools_layout(num_blocks=3))
    cache.add("a")
    with pytest.raises(AllocationError, match="group 0 has no free block left"):
        cache.schedule("a", list(range(9)))
    assert [cache.num_free(g) for g in range(3)] == [2, 2, 1]
    assert cache.block_table("a", 0) == ()
    cache.check_invariants()


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"prefix_of": "zz", "prefix_len": 4}, "unknown request id 'zz'"),
        (
            {"prefix_of": "a", "prefix_len": 6},
            "prefix_len 6 is not a multiple of group 0's block size 4",
        ),
        ({"prefix_of": "a", "prefix_len": 12}, "prefix_len 12 must be in 1..8"),
        (
            {"prefix_of": "a", "prefix_len": 4},
            "no state checkpoint at 4 tokens in group 2; it has [8]",
        ),
        ({"prefix_len": 4}, "prefix_len needs prefix_of"),
    ],
)
def test_add_rejects_bad_prefixes(kw: dict[str, object], message: str) -> None:
    cache = ToyCache(pools_layout())
    cache.add("a")
    cache.commit(cache.schedule("a", list(range(8))))
    with pytest.raises(RequestError, match=re.escape(message)):
        cache.add("b", **kw)  # type: ignore[arg-type]
    with pytest.raises(RequestError, match="already registered"):
        cache.add("a")
    cache.check_invariants()
