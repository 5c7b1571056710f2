"""Dead tails: a freed request's attention blocks past the longest hit its tokens have."""

from __future__ import annotations

import pytest

from hybridkv.cache import BlockRemoved, KVCacheManager
from hybridkv.cache.policies import DEAD_TAILS
from hybridkv.errors import PlanError
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


def _manager(dead_tails: str, **kw: object) -> KVCacheManager:
    return KVCacheManager(
        uniform(groups(full(), state()), 40),
        dead_tails=dead_tails,
        **kw,  # type: ignore[arg-type]
    )


def test_without_a_checkpoint_every_attention_block_of_a_freed_request_is_dead() -> None:
    kept, dropped = _manager("keep"), _manager("drop", enable_kv_events=True)
    for mgr in (kept, dropped):
        run_to_completion(mgr, mgr.make_request("r0", tokens(10)))  # ends at 10: no checkpoint
    h = kept.make_request("x", tokens(10)).block_hashes
    assert set(kept.pool.maps[0]) == {h[0], h[1]}  # LRU keeps both blocks
    assert dropped.pool.maps[0] == {} and dropped.pool.maps[1] == {}
    removed = [e for e in dropped.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(x for e in removed for x in e.block_hashes) == sorted((h[0], h[1]))
    # The dropped blocks are free and uncached: used before any cached block is evicted.
    assert dropped.pool.num_free(0) == kept.pool.num_free(0)
    # What dropping costs: the next request no longer sees where the first one branched.
    r1 = [*tokens(10), 1]
    assert kept.get_computed_blocks(kept.make_request("k1", r1)).junction_tokens == 8
    assert dropped.get_computed_blocks(dropped.make_request("d1", r1)).junction_tokens == 0
    kept.check_invariants()
    dropped.check_invariants()


def test_blocks_up_to_the_last_checkpoint_stay_and_serve_the_next_request() -> None:
    mgr = _manager("drop")
    r0 = mgr.make_request("r0", tokens(14))
    h = r0.block_hashes
    admit(mgr, r0, budget=8)  # ends at 8: a state checkpoint there
    step(r0, 8)
    assert mgr.allocate_slots(r0, 6) is not None
    step(r0, 6)
    mgr.free("r0")
    assert set(mgr.pool.maps[0]) == {h[0], h[1]}  # block 2 (tokens 8..12) lies past the hit
    assert set(mgr.pool.maps[1]) == {h[1]}
    r1 = mgr.make_request("r1", [*tokens(14), 7])
    assert mgr.get_computed_blocks(r1).num_computed_tokens == 8
    mgr.check_invariants()


def test_auto_drops_only_without_lower_tiers() -> None:
    from hybridkv.cache.tiers import TierSpec

    layout = uniform(groups(full(), state()), 40)
    plain = KVCacheManager(layout, dead_tails="auto")
    tiered = KVCacheManager(layout, dead_tails="auto", tiers=[TierSpec("host", 1 << 20)])
    assert plain._coord.dead_tails is not None and tiered._coord.dead_tails is None
    # Only where a group that is not prefix-closed bounds hits: none to drop otherwise.
    attention_only = KVCacheManager(uniform(groups(full()), 40), dead_tails="drop")
    assert attention_only._coord.dead_tails is None


def test_blocks_another_request_read_are_not_dropped() -> None:
    mgr = _manager("drop")
    r0 = mgr.make_request("r0", tokens(10))
    _, res = admit(mgr, r0)
    assert res is not None
    blocks = list(mgr.get_block_ids("r0")[0])
    assert mgr.pool.untouched(0, blocks) == blocks  # nobody else read them
    mgr.pool.touch(0, blocks[:1])  # as a hit of another request would
    assert mgr.pool.untouched(0, blocks) == blocks[1:]
    mgr.pool.release(0, blocks[:1])
    step(r0, 10)
    mgr.free("r0")
    assert list(mgr.pool.maps[0]) == [r0.block_hashes[0]]  # the block read by another stays
    mgr.check_invariants()


def test_a_pool_without_chances_cannot_tell_and_drops_nothing() -> None:
    mgr = _manager("drop", second_chance=0)
    run_to_completion(mgr, mgr.make_request("r0", tokens(10)))
    assert len(mgr.pool.maps[0]) == 2


def test_an_unknown_policy_is_refused() -> None:
    with pytest.raises(PlanError, match=r"dead_tails: unknown policy 'some'; valid: auto, d"):
        _manager("some")
    assert DEAD_TAILS == ("auto", "drop", "keep")
    default = KVCacheManager(uniform(groups(full(), state()), 40))
    assert default._coord.dead_tails is not None  # auto, no tiers: dropped
