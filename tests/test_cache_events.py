"""KV events for routers and prefix-cache statistics."""

from __future__ import annotations

from hybridkv.cache import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheManager
from test_cache_factories import (
    admit,
    full,
    groups,
    run_to_completion,
    state,
    step,
    tokens,
    uniform,
)


def test_block_stored_carries_group_hashes_parent_and_token_count() -> None:
    layout = uniform(groups(full(), (full(), 8), state()), 40)
    mgr = KVCacheManager(layout, enable_kv_events=True, publish="computed")
    r0 = mgr.make_request("r0", tokens(17))
    h = r0.block_hashes  # hash-block size 4
    admit(mgr, r0, budget=8)  # ends at 8: a state checkpoint
    step(r0, 8)
    assert mgr.take_events() == []  # nothing is published before it is computed
    assert mgr.allocate_slots(r0, 8) is not None
    assert mgr.take_events() == [
        BlockStored(0, (h[0], h[1]), None, 8, 4),
        BlockStored(1, (h[1],), None, 8, 8),
        BlockStored(2, (h[1],), h[0], 4, 4),
    ]
    step(r0, 8)
    mgr.free("r0")
    assert mgr.take_events() == [
        BlockStored(0, (h[2], h[3]), h[1], 8, 4),
        BlockStored(1, (h[3],), h[1], 8, 8),
        BlockStored(2, (h[3],), h[2], 4, 4),
    ]
    assert mgr.take_events() == []
    assert mgr.reset_prefix_cache()
    assert mgr.take_events() == [AllBlocksCleared()]


def test_scheduled_publication_stores_attention_blocks_at_their_allocation() -> None:
    layout = uniform(groups(full(), (full(), 8), state()), 40)
    mgr = KVCacheManager(layout, enable_kv_events=True)  # publish="scheduled", the default
    r0 = mgr.make_request("r0", tokens(17))
    h = r0.block_hashes
    admit(mgr, r0, budget=8)  # the step that fills tokens 0..8: attention blocks at once
    assert mgr.take_events() == [
        BlockStored(0, (h[0], h[1]), None, 8, 4),
        BlockStored(1, (h[1],), None, 8, 8),
    ]
    step(r0, 8)
    assert mgr.allocate_slots(r0, 8) is not None  # the state checkpoint at 8 once computed
    assert mgr.take_events() == [
        BlockStored(2, (h[1],), h[0], 4, 4),
        BlockStored(0, (h[2], h[3]), h[1], 8, 4),
        BlockStored(1, (h[3],), h[1], 8, 8),
    ]
    step(r0, 8)
    mgr.free("r0")
    assert mgr.take_events() == [BlockStored(2, (h[3],), h[2], 4, 4)]
    mgr.check_invariants()


def test_blocks_published_for_a_step_that_never_ran_are_taken_back() -> None:
    mgr = KVCacheManager(uniform(groups(full(), state()), 40), enable_kv_events=True)
    r0 = mgr.make_request("r0", tokens(17))
    h = r0.block_hashes
    admit(mgr, r0, budget=8)
    assert mgr.get_computed_blocks(mgr.make_request("q", tokens(17))).junction_tokens == 8
    mgr.preempt("r0")  # before the step ran: its blocks hold nothing
    assert mgr.take_events() == [
        BlockStored(0, (h[0], h[1]), None, 8, 4),
        BlockRemoved(0, (h[0], h[1])),
    ]
    hit = mgr.get_computed_blocks(mgr.make_request("q", tokens(17)))
    assert (hit.num_computed_tokens, hit.junction_tokens) == (0, 0)
    mgr.check_invariants()
    admit(mgr, r0, budget=8)  # re-admitted: publishes again; computed this time, then freed
    step(r0, 8)
    mgr.free("r0")
    hit = mgr.get_computed_blocks(mgr.make_request("q", tokens(17)))
    assert (hit.num_computed_tokens, hit.junction_tokens) == (8, 8)
    mgr.check_invariants()


def test_block_removed_on_eviction() -> None:
    mgr = KVCacheManager(uniform(groups(full()), 4), enable_kv_events=True)
    r0 = mgr.make_request("r0", tokens(8))
    run_to_completion(mgr, r0)
    mgr.take_events()
    r1 = mgr.make_request("r1", tokens(12, start=50))
    assert admit(mgr, r1)[1] is not None
    assert mgr.take_events() == [
        BlockRemoved(0, (r0.block_hashes[1],)),
        BlockRemoved(0, (r0.block_hashes[0],)),
        BlockStored(0, tuple(r1.block_hashes), None, 12, 4),  # published for its step
    ]


def test_events_off_by_default() -> None:
    mgr = KVCacheManager(uniform(groups(full()), 8))
    run_to_completion(mgr, mgr.make_request("r0", tokens(8)))
    assert mgr.take_events() == []


def test_prefix_cache_stats_intervals_and_alone_hits() -> None:
    mgr = KVCacheManager(
        uniform(groups(full(), state()), 40), group_hit_stats=True, dead_tails="keep"
    )  # kept: r0's blocks past its (missing) checkpoint still count for attention alone
    run_to_completion(mgr, mgr.make_request("r0", tokens(10)))  # ends at 10: no checkpoint
    r1 = mgr.make_request("r1", [*tokens(10), 1])
    hit = mgr.get_computed_blocks(r1)
    assert hit.num_computed_tokens == 0 and hit.junction_tokens == 8
    s = mgr.make_prefix_cache_stats()
    assert (s.queries, s.query_tokens, s.hit_tokens, s.group_alone_hit_tokens) == (2, 21, 0, (8, 0))
    assert s.hit_rate == 0.0 and not s.reset
    r2 = mgr.make_request("r2", tokens(8))
    admit(mgr, r2)
    step(r2, 8)
    mgr.free("r2")  # publishes a checkpoint at 8
    hit = mgr.get_computed_blocks(r1)
    assert hit.num_computed_tokens == 8
    s = mgr.make_prefix_cache_stats()
    assert (s.queries, s.query_tokens, s.hit_tokens, s.group_alone_hit_tokens) == (
        2,
        19,
        8,
        (12, 8),
    )
    assert s.hit_rate == 8 / 19
    total = mgr.stats
    assert (total.queries, total.query_tokens, total.hit_tokens) == (4, 40, 8)
    assert mgr.make_prefix_cache_stats().queries == 0
