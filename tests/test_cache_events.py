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
    swa,
    tokens,
    uniform,
)


def T(start: int, end: int) -> tuple[int, ...]:
    """The token ids ``start .. end - 1`` (the factories' prompts count up)."""
    return tuple(range(start, end))


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
        BlockStored(0, (h[0], h[1]), None, 8, 4, token_ids=T(0, 8)),
        BlockStored(1, (h[1],), None, 8, 8, token_ids=T(0, 8)),
        BlockStored(2, (h[1],), h[0], 4, 4, token_ids=T(4, 8)),  # the checkpoint's block
    ]
    step(r0, 8)
    mgr.free("r0")
    assert mgr.take_events() == [
        BlockStored(0, (h[2], h[3]), h[1], 8, 4, token_ids=T(8, 16)),
        BlockStored(1, (h[3],), h[1], 8, 8, token_ids=T(8, 16)),
        BlockStored(2, (h[3],), h[2], 4, 4, token_ids=T(12, 16)),
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
        BlockStored(0, (h[0], h[1]), None, 8, 4, token_ids=T(0, 8)),
        BlockStored(1, (h[1],), None, 8, 8, token_ids=T(0, 8)),
    ]
    step(r0, 8)
    assert mgr.allocate_slots(r0, 8) is not None  # the state checkpoint at 8 once computed
    assert mgr.take_events() == [
        BlockStored(2, (h[1],), h[0], 4, 4, token_ids=T(4, 8)),
        BlockStored(0, (h[2], h[3]), h[1], 8, 4, token_ids=T(8, 16)),
        BlockStored(1, (h[3],), h[1], 8, 8, token_ids=T(8, 16)),
    ]
    step(r0, 8)
    mgr.free("r0")
    assert mgr.take_events() == [BlockStored(2, (h[3],), h[2], 4, 4, token_ids=T(12, 16))]
    mgr.check_invariants()


def test_blocks_published_for_a_step_that_never_ran_are_taken_back() -> None:
    mgr = KVCacheManager(uniform(groups(full(), state()), 40), enable_kv_events=True)
    r0 = mgr.make_request("r0", tokens(17))
    h = r0.block_hashes
    admit(mgr, r0, budget=8)
    assert mgr.get_computed_blocks(mgr.make_request("q", tokens(17))).junction_tokens == 8
    mgr.preempt("r0")  # before the step ran: its blocks hold nothing
    assert mgr.take_events() == [
        BlockStored(0, (h[0], h[1]), None, 8, 4, token_ids=T(0, 8)),
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
        BlockStored(0, tuple(r1.block_hashes), None, 12, 4, token_ids=T(50, 62)),
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


def test_stored_events_carry_the_tokens_and_lora_a_router_rehashes() -> None:
    """Each device BlockStored names the tokens its blocks cover (decoded ones included) and
    the request's LoRA id, as vLLM's event does; hashing those tokens after the event's
    parent with the manager's hasher gives the event's hashes (a router that keys on hashes
    of its own can follow). A sliding-window group publishes only what its window holds."""
    layout = uniform(groups(full(), swa(4)), 40)
    mgr = KVCacheManager(layout, enable_kv_events=True, publish="computed")
    r0 = mgr.make_request("r0", tokens(10), lora_id="adapter-a")
    run_to_completion(mgr, r0, outputs=[90, 91])  # 12 tokens: three 4-token blocks
    events = mgr.take_events()
    assert [(e.group_id, e.token_ids, e.lora_id) for e in events] == [  # type: ignore[union-attr]
        (0, T(0, 8), "adapter-a"),  # the prompt's two whole blocks
        (1, T(4, 8), "adapter-a"),  # the window's block (tokens 0-3 left it)
        (0, (8, 9, 90, 91), "adapter-a"),  # filled by the decode
        (1, (8, 9, 90, 91), "adapter-a"),
    ]
    prompt = [*tokens(10), 90, 91, 7, 7, 7, 7, 5]
    r1 = mgr.make_request("r1", prompt)  # no LoRA: other hashes, no hit
    run_to_completion(mgr, r1)
    r2 = mgr.make_request("r2", prompt, lora_id="adapter-a")
    hit, _ = admit(mgr, r2)
    assert hit.num_computed_tokens == 12
    step(r2, r2.num_tokens - 12)
    mgr.free("r2")
    events = mgr.take_events()
    assert [(e.group_id, e.token_ids, e.lora_id) for e in events] == [  # type: ignore[union-attr]
        (0, (*T(0, 10), 90, 91, 7, 7, 7, 7), None),
        (1, (7, 7, 7, 7), None),
        (0, (7, 7, 7, 7), "adapter-a"),  # after the hit
        (1, (7, 7, 7, 7), "adapter-a"),
    ]
    assert [e.parent_block_hash for e in events] == [  # type: ignore[union-attr]
        None,
        r1.block_hashes[2],
        r2.block_hashes[2],
        r2.block_hashes[2],
    ]
    for e in events[:2]:  # without extra keys the tokens alone give the hashes
        again = mgr.hasher.hash_blocks(e.parent_block_hash, e.token_ids, 4)  # type: ignore[union-attr]
        assert tuple(again) == e.block_hashes  # type: ignore[union-attr]
