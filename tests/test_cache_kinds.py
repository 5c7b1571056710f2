"""Per-kind rules: the state-copy contract, sinks, and what each kind releases and caches."""

from __future__ import annotations

from hybridkv.cache import BlockStored, KVCacheManager, StateCopy, StateSlot
from hybridkv.cache.kinds import KIND_MANAGERS, manager_class
from hybridkv.specs import CacheKind
from test_cache_factories import (
    admit,
    full,
    groups,
    pools,
    run_to_completion,
    state,
    step,
    swa,
    tokens,
    uniform,
)


def test_registry_dispatches_on_kind() -> None:
    assert manager_class(CacheKind.MLA) is manager_class(CacheKind.FULL)
    assert set(KIND_MANAGERS) == set(CacheKind) - {CacheKind.NONE}


def test_state_running_slot_checkpoints_and_restores() -> None:
    mgr = KVCacheManager(pools(groups(full(), state()), 10))
    r0 = mgr.make_request("r0", tokens(13))
    _, res = admit(mgr, r0, budget=8)
    assert res is not None
    assert res.new_block_ids == ((1, 2), (1,))
    assert res.zero_before == (StateSlot(1, 1),)  # type: ignore[arg-type]
    assert res.copies_after == (StateCopy(1, 1, 2),)  # type: ignore[arg-type]
    assert mgr.get_block_ids("r0") == ([1, 2], [1])
    assert mgr.is_allocated(1, 2)  # the checkpoint is held until it is published
    step(r0, 8)
    res = mgr.allocate_slots(r0, 4)  # publishes 8; the step ends at 12: another checkpoint
    assert res is not None and res.copies_after == (StateCopy(1, 1, 3),)  # type: ignore[arg-type]
    assert not mgr.is_allocated(1, 2)
    # The step did not run (the scheduler did not advance): the checkpoint at 12 is dropped.
    res = mgr.allocate_slots(r0, 1)
    assert res is not None and res.copies_after == ()
    assert not mgr.is_allocated(1, 3)
    step(r0, 1)
    mgr.free("r0")
    mgr.check_invariants()

    r1 = mgr.make_request("r1", [*tokens(12), 99])
    hit = mgr.get_computed_blocks(r1)
    assert hit.num_computed_tokens == 8 and hit.blocks == ((1, 2), (2,))
    _, res = admit(mgr, r1)
    assert res is not None
    running = mgr.get_block_ids("r1")[1][0]
    assert res.copies_before == (StateCopy(1, 2, running),)  # type: ignore[arg-type]
    assert res.zero_before == () and res.copies_after == ()
    assert mgr.is_allocated(1, 2)  # held until the runner copied it (the next call)
    step(r1, 5)
    r1.append_token_ids([1, 2, 3])
    assert mgr.allocate_slots(r1, 3) is not None  # ends at 16: checkpoint
    assert not mgr.is_allocated(1, 2)
    mgr.check_invariants()


def test_state_checkpoints_are_published_once() -> None:
    mgr = KVCacheManager(uniform(groups(full(), state()), 30), enable_kv_events=True)
    a = mgr.make_request("a", tokens(9))
    b = mgr.make_request("b", tokens(9))
    res_a = mgr.allocate_slots(a, 8)
    res_b = mgr.allocate_slots(b, 8)  # same step: both save a checkpoint at 8
    assert res_a is not None and res_b is not None
    assert res_a.copies_after == (StateCopy(1, 3, 4),)  # type: ignore[arg-type]
    assert res_b.copies_after == (StateCopy(1, 7, 8),)  # type: ignore[arg-type]
    step(a, 8)
    step(b, 8)
    assert mgr.allocate_slots(a, 1) is not None  # publishes a's checkpoint (block 4)
    assert mgr.allocate_slots(b, 1) is not None  # b's (block 8) is a duplicate: dropped
    stored = [e for e in mgr.take_events() if e.group_id == 1]  # type: ignore[union-attr]
    assert len(stored) == 1
    assert not mgr.is_allocated(1, 8) and mgr._coord.pool.hashes[1][8] is None
    # Without using the hit, a step ending at 8 does not save a checkpoint that exists.
    c = mgr.make_request("c", tokens(9))
    res_c = mgr.allocate_slots(c, 8)
    assert res_c is not None and res_c.copies_after == () and len(res_c.zero_before) == 1
    mgr.check_invariants()


def test_sliding_window_sinks_stay_and_gate_hits() -> None:
    mgr = KVCacheManager(uniform(groups(swa(4, sinks=2)), 30))
    r0 = mgr.make_request("r0", tokens(16))
    admit(mgr, r0)
    step(r0, 16)
    r0.append_token_ids([1])
    assert mgr.allocate_slots(r0, 1) is not None
    # sink block 0 stays; block 2 (tokens 4..8) left the window uncached (no hit at a
    # likely position reads it: tail retention), so it is the first block reused
    assert mgr.get_block_ids("r0") == ([1, 0, 0, 4, 2],)
    step(r0, 1)
    mgr.free("r0")
    hit = mgr.get_computed_blocks(mgr.make_request("r1", [*tokens(16), 7]))
    assert hit.num_computed_tokens == 16 and hit.blocks == ((1, 0, 0, 4),)
    mgr.check_invariants()


def _window_run(retention: str) -> tuple[KVCacheManager, list[int]]:
    """A 20-token prompt on a 4-token window (blocks of 4, alignment 4), 2 decoded tokens."""
    mgr = KVCacheManager(
        uniform(groups(swa(4)), 30), enable_kv_events=True, window_retention=retention
    )
    r0 = mgr.make_request("r0", tokens(20))
    run_to_completion(mgr, r0, outputs=[1, 2])
    stored = [
        r0.block_hashes.index(h)
        for e in mgr.take_events()
        if isinstance(e, BlockStored)
        for h in e.block_hashes
    ]
    return mgr, stored


def test_window_tail_retention_caches_only_likely_hit_tails() -> None:
    # tails: a hit at the prompt's end (19 -> 16 resend, 20 sibling) reads blocks 3 and 4;
    # the computed end (22 -> 20) reads block 4 too.  Blocks 0..2 leave uncached.
    mgr, stored = _window_run("tails")
    assert sorted(stored) == [3, 4]
    assert mgr.get_computed_blocks(mgr.make_request("resend", tokens(20))).num_computed_tokens == 16
    longer = mgr.make_request("longer", [*tokens(20), 9, 9])
    assert mgr.get_computed_blocks(longer).num_computed_tokens == 20
    # a sibling sharing 12 tokens needs block 2 (tokens 8..12): not kept, no hit
    sibling = mgr.make_request("sibling", [*tokens(12), 50, 51, 52])
    assert mgr.get_computed_blocks(sibling).num_computed_tokens == 0
    mgr.check_invariants()
    mgr, stored = _window_run("all")
    assert sorted(stored) == [0, 1, 2, 3, 4]
    sibling = mgr.make_request("sibling", [*tokens(12), 50, 51, 52])
    assert mgr.get_computed_blocks(sibling).num_computed_tokens == 12


def test_window_grid_keeps_tails_at_multiples_next_to_a_prefix_group() -> None:
    # equal bytes per token in the full and the 4-token-window group: grid = 16 * 4 = 64
    mgr = KVCacheManager(uniform(groups(full(), swa(4)), 200), enable_kv_events=True)
    assert [m.window_grid for m in mgr._coord.managers] == [0, 64]
    r0 = mgr.make_request("r0", tokens(150))
    run_to_completion(mgr, r0)
    stored = sorted(
        r0.block_hashes.index(h)
        for e in mgr.take_events()
        if isinstance(e, BlockStored) and e.group_id == 1
        for h in e.block_hashes
    )
    # tails before 64 and 128 (the grid) and before 148 (the prompt's end, aligned)
    assert stored == [15, 31, 36]
    sibling = mgr.make_request("sibling", [*tokens(130), 7, 7])
    assert mgr.get_computed_blocks(sibling).num_computed_tokens == 128
    mgr.check_invariants()
