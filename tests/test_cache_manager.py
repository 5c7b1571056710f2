"""Scenario tests of KVCacheManager: exact block ids, hit lengths and eviction order."""

from __future__ import annotations

from typing import Any

import pytest

from hybridkv.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheManager,
    StateCopy,
    StateSlot,
    compiled,
)
from hybridkv.cache.errors import RequestLengthError
from hybridkv.errors import PlanError
from test_cache_factories import (
    admit,
    arena,
    chunked,
    full,
    groups,
    mla,
    pools,
    run_to_completion,
    state,
    step,
    swa,
    tokens,
    uniform,
)


def test_one_full_group_allocate_decode_free_and_hit() -> None:
    mgr = KVCacheManager(uniform(groups(full()), 10))
    r0 = mgr.make_request("r0", tokens(10))
    hit, res = admit(mgr, r0)
    assert hit.num_computed_tokens == 0 and hit.blocks == ((),)
    assert res is not None and res.new_block_ids == ((1, 2, 3),)
    assert res.copies_before == res.copies_after == res.zero_before == ()
    step(r0, 10)
    r0.append_token_ids([100])
    res = mgr.allocate_slots(r0, 1)
    assert res is not None and res.new_block_ids == ((),)
    step(r0, 1)
    r0.append_token_ids([101])
    assert mgr.allocate_slots(r0, 1) is not None
    step(r0, 1)
    r0.append_token_ids([102])
    res = mgr.allocate_slots(r0, 1)
    assert res is not None and res.new_block_ids == ((4,),)
    assert mgr.get_block_ids("r0") == ([1, 2, 3, 4],)
    mgr.check_invariants()
    step(r0, 1)  # 13 computed: blocks 0..2 are full and computed
    mgr.free("r0")
    mgr.check_invariants()
    assert mgr.usage == 0.0

    r1 = mgr.make_request("r1", [*tokens(8), 100, 101, 50, 51, 52])
    hit = mgr.get_computed_blocks(r1)
    assert hit.num_computed_tokens == 8 and hit.blocks == ((1, 2),)
    r2 = mgr.make_request("r2", [*tokens(10), 100, 101, 7])
    hit = mgr.get_computed_blocks(r2)  # bound 12 = 3 blocks, all cached
    assert hit.num_computed_tokens == 12 and hit.blocks == ((1, 2, 3),)
    hit, res = admit(mgr, r2)
    assert res is not None and res.new_block_ids == ((4,),)  # the uncached tail block, reused
    assert mgr.get_block_ids("r2") == ([1, 2, 3, 4],)
    mgr.check_invariants()


def test_lru_eviction_takes_the_tail_first() -> None:
    mgr = KVCacheManager(uniform(groups(full()), 7), enable_kv_events=True)
    r0 = mgr.make_request("r0", tokens(12))
    run_to_completion(mgr, r0)  # blocks 1, 2, 3 cached; freed tail first: LRU = [3, 2, 1]
    stored = mgr.take_events()
    assert [type(e) for e in stored] == [BlockStored]
    h = stored[0].block_hashes  # type: ignore[union-attr]
    assert len(h) == 3 and stored[0].token_count == 12  # type: ignore[union-attr]

    r1 = mgr.make_request("r1", tokens(20, start=1000))
    _, res = admit(mgr, r1)
    assert res is not None and res.new_block_ids == ((4, 5, 6, 3, 2),)
    assert mgr.take_events() == [
        BlockRemoved(0, (h[2],)),
        BlockRemoved(0, (h[1],)),
        BlockStored(0, tuple(r1.block_hashes), None, 20, 4, token_ids=tuple(r1.token_ids)),
    ]
    r2 = mgr.make_request("r2", tokens(13))
    hit = mgr.get_computed_blocks(r2)
    assert hit.num_computed_tokens == 4 and hit.blocks == ((1,),)
    mgr.check_invariants()


def test_full_plus_sliding_window_releases_and_hits() -> None:
    mgr = KVCacheManager(uniform(groups(full(), swa(8)), 20), window_retention="all")
    r0 = mgr.make_request("r0", tokens(18))
    _, res = admit(mgr, r0)
    assert res is not None and res.new_block_ids == ((1, 2, 3, 4, 5), (6, 7, 8, 9, 10))
    step(r0, 18)
    r0.append_token_ids([100])
    res = mgr.allocate_slots(r0, 1)  # queries >= 18 read tokens >= 11: SWA blocks 0, 1 leave
    assert res is not None and res.new_block_ids == ((), ())
    assert mgr.get_block_ids("r0") == ([1, 2, 3, 4, 5], [0, 0, 8, 9, 10])
    step(r0, 1)
    r0.append_token_ids([101])
    assert mgr.allocate_slots(r0, 1) is not None
    assert mgr.get_block_ids("r0") == ([1, 2, 3, 4, 5], [0, 0, 0, 9, 10])
    step(r0, 1)
    mgr.check_invariants()
    mgr.free("r0")

    r1 = mgr.make_request("r1", [*tokens(18), 100, 101, 5])
    hit = mgr.get_computed_blocks(r1)
    assert hit.num_computed_tokens == 20
    assert hit.blocks == ((1, 2, 3, 4, 5), (0, 0, 0, 9, 10))
    _, res = admit(mgr, r1)
    assert res is not None and res.new_block_ids == ((11,), (12,))
    mgr.check_invariants()


def test_sliding_window_frees_before_allocating_in_the_same_call() -> None:
    # 6 usable blocks: r0 holds 3 SWA blocks; its next chunk needs 3 more, and only fits
    # because the 2 out-of-window blocks are released first within the call.
    mgr = KVCacheManager(uniform(groups(swa(4)), 5), window_retention="all")
    r0 = mgr.make_request("r0", tokens(24))
    _, res = admit(mgr, r0, budget=12)
    assert res is not None and res.new_block_ids == ((1, 2, 3),)
    step(r0, 12)
    res = mgr.allocate_slots(r0, 4)  # queries >= 12 read >= 9: blocks 0, 1 go, block 3 comes
    assert res is not None and res.new_block_ids == ((4,),)
    assert mgr.get_block_ids("r0") == ([0, 0, 3, 4],)
    step(r0, 4)
    res = mgr.allocate_slots(r0, 8)  # releases block 2 (index 2), needs 2: free 4 - 0 + ...
    assert res is not None and res.new_block_ids == ((2, 1),)
    assert mgr.get_block_ids("r0") == ([0, 0, 0, 4, 2, 1],)
    mgr.check_invariants()


def test_three_groups_two_windows_and_state_fixed_point() -> None:
    gs = groups(full(), swa(8), (swa(12), 8), (state(), 8))
    mgr = KVCacheManager(pools(gs, 30), window_retention="all", group_hit_stats=True)
    assert (mgr.hash_block_size, mgr.schedule_alignment) == (4, 8)
    r0 = mgr.make_request("r0", tokens(24))
    _, res = admit(mgr, r0)
    assert res is not None
    assert res.new_block_ids == ((1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5, 6), (1, 2, 3), (1,))
    assert res.zero_before == (StateSlot(3, 1),)  # type: ignore[arg-type]
    assert res.copies_after == (StateCopy(3, 1, 2),)  # type: ignore[arg-type]
    step(r0, 24)
    r0.append_token_ids([100])
    res = mgr.allocate_slots(r0, 1)  # publishes the checkpoint at 24, releases window blocks
    assert res is not None and res.new_block_ids == ((7,), (7,), (4,), ())
    assert res.copies_after == ()
    assert mgr.get_block_ids("r0") == (
        [1, 2, 3, 4, 5, 6, 7],
        [0, 0, 0, 0, 5, 6, 7],
        [0, 2, 3, 4],
        [1],
    )
    step(r0, 1)
    mgr.free("r0")
    mgr.check_invariants()

    r1 = mgr.make_request("r1", [*tokens(24), 200, 201, 202, 203, 204, 205])
    hit = mgr.get_computed_blocks(r1)
    assert hit.num_computed_tokens == 24
    assert hit.blocks == ((1, 2, 3, 4, 5, 6), (0, 0, 0, 0, 5, 6), (0, 2, 3), (2,))

    # Shares 20 tokens: attention groups alone could serve 16, the state group nothing.
    r2 = mgr.make_request("r2", [*tokens(20), *tokens(10, start=500)])
    hit = mgr.get_computed_blocks(r2)
    assert hit.num_computed_tokens == 0 and hit.junction_tokens == 16
    assert mgr.stats.group_alone_hit_tokens == (24 + 16, 24 + 16, 24 + 16, 24 + 0)
    _, res = admit(mgr, r2, budget=hit.junction_tokens)  # end the step at the junction
    assert res is not None and len(res.copies_after) == 1
    step(r2, 16)
    assert mgr.allocate_slots(r2, 14) is not None  # publishes the checkpoint at 16
    r3 = mgr.make_request("r3", [*tokens(20), 9, 9, 9, 9, 9])
    hit = mgr.get_computed_blocks(r3)
    assert hit.num_computed_tokens == 16
    state_hit = hit.blocks[3]
    _, res = admit(mgr, r3)
    assert res is not None
    assert res.copies_before == (StateCopy(3, state_hit[0], mgr.get_block_ids("r3")[3][0]),)
    mgr.check_invariants()


def test_interleaved_group_order_gives_the_same_hits() -> None:
    a = KVCacheManager(pools(groups(full(), swa(8), (state(), 8)), 30))
    b = KVCacheManager(pools(groups((state(), 8), swa(8), full()), 30))
    for mgr in (a, b):
        run_to_completion(mgr, mgr.make_request("r0", tokens(24)), outputs=[1, 2, 3])
        hit = mgr.get_computed_blocks(mgr.make_request("r1", [*tokens(24), 1, 2, 3, 4]))
        assert hit.num_computed_tokens == 24
        mgr.check_invariants()
    ha = a.get_computed_blocks(a.make_request("x", [*tokens(24), 1, 2, 3, 4])).blocks
    hb = b.get_computed_blocks(b.make_request("x", [*tokens(24), 1, 2, 3, 4])).blocks
    assert ha == hb[::-1]


def test_sliding_window_only_hits_scan_from_the_right() -> None:
    mgr = KVCacheManager(uniform(groups(swa(8)), 20))
    run_to_completion(mgr, mgr.make_request("r0", tokens(16)))
    # A request diverging at token 14: L=12 needs blocks 1, 2 (tokens 5..11): cached.
    r1 = mgr.make_request("r1", [*tokens(14), 77, 77, 77])
    hit = mgr.get_computed_blocks(r1)
    assert hit.num_computed_tokens == 12 and hit.blocks == ((0, 2, 3),)
    mgr.check_invariants()


def test_state_plus_sliding_window_without_full_attention() -> None:
    mgr = KVCacheManager(uniform(groups(swa(8), state()), 20))
    r0 = mgr.make_request("r0", tokens(10))
    _, res = admit(mgr, r0, budget=8)  # ends on a boundary: a checkpoint
    assert res is not None and res.new_block_ids == ((1, 2), (3,))
    assert res.copies_after == (StateCopy(1, 3, 4),)  # type: ignore[arg-type]
    step(r0, 8)
    res = mgr.allocate_slots(r0, 2)
    assert res is not None and res.new_block_ids == ((5,), ()) and res.copies_after == ()
    step(r0, 2)
    mgr.free("r0")
    mgr.check_invariants()
    r1 = mgr.make_request("r1", [*tokens(8), 50, 51, 52])
    hit = mgr.get_computed_blocks(r1)
    assert hit.num_computed_tokens == 8 and hit.blocks == ((1, 2), (4,))


def test_chunked_local_attention_keeps_only_the_current_chunk() -> None:
    mgr = KVCacheManager(uniform(groups(full(), chunked(8)), 30), window_retention="all")
    r0 = mgr.make_request("r0", tokens(20))
    _, res = admit(mgr, r0)
    assert res is not None
    step(r0, 20)
    r0.append_token_ids([1])
    assert mgr.allocate_slots(r0, 1) is not None  # queries >= 20 read chunk [16, 24)
    assert mgr.get_block_ids("r0") == ([1, 2, 3, 4, 5, 11], [0, 0, 0, 0, 10, 12])
    step(r0, 1)
    mgr.free("r0")
    hit = mgr.get_computed_blocks(mgr.make_request("r1", [*tokens(20), 1, 5]))
    assert hit.num_computed_tokens == 20 and hit.blocks[1] == (0, 0, 0, 0, 10)
    hit = mgr.get_computed_blocks(mgr.make_request("r2", [*tokens(18), 5]))
    assert hit.num_computed_tokens == 16 and hit.blocks[1] == (0, 0, 0, 0)
    mgr.check_invariants()


def test_mla_follows_the_full_attention_rule() -> None:
    mgr = KVCacheManager(arena(groups(mla()), 6))
    run_to_completion(mgr, mgr.make_request("r0", tokens(12)), outputs=[5])
    hit = mgr.get_computed_blocks(mgr.make_request("r1", [*tokens(12), 5, 6]))
    # one group: chunk 0 lends it every id past the null block, so ids start at 1
    assert hit.num_computed_tokens == 12 and hit.blocks == ((1, 2, 3),)
    mgr.check_invariants()


@pytest.mark.parametrize(("value", "message"), [(0, "got 0"), (-1, "got -1")])
def test_max_model_len_must_be_positive(value: Any, message: str) -> None:
    """0 was accepted and then refused every request (found by a review)."""
    with pytest.raises(RequestLengthError, match=f"max_model_len: must be .*{message}"):
        KVCacheManager(uniform(groups(full()), 20), max_model_len=value)


def test_lookahead_slots() -> None:
    mgr = KVCacheManager(uniform(groups(full(), swa(4)), 20))
    r0 = mgr.make_request("r0", tokens(8))
    hit = mgr.get_computed_blocks(r0)
    res = mgr.allocate_slots(r0, 8, new_computed_blocks=hit, num_lookahead_tokens=5)
    assert res is not None and res.new_block_ids == ((1, 2, 3, 4), (5, 6, 7, 8))
    step(r0, 8)
    r0.append_token_ids([1])
    res = mgr.allocate_slots(r0, 1, num_lookahead_tokens=3)  # 12 slots: already there
    assert res is not None and res.new_block_ids == ((), ())
    step(r0, 1)
    r0.append_token_ids([2])
    res = mgr.allocate_slots(r0, 1, num_lookahead_tokens=11)  # 21 slots: 6 blocks
    assert res is not None and res.new_block_ids == ((9, 10), (11, 12))
    assert mgr.get_block_ids("r0") == ([1, 2, 3, 4, 9, 10], [0, 6, 7, 8, 11, 12])
    mgr.check_invariants()


def test_reserved_slots_cover_the_prompt_in_prefix_closed_groups_only() -> None:
    mgr = KVCacheManager(uniform(groups(full(), swa(4), state()), 20))
    r0 = mgr.make_request("r0", tokens(20))
    hit = mgr.get_computed_blocks(r0)
    res = mgr.allocate_slots(r0, 8, new_computed_blocks=hit, num_reserved_tokens=12)
    # full attention takes the whole prompt's 5 blocks; the window only the step's 2; the
    # state its running slot
    assert res is not None and res.new_block_ids == ((1, 2, 3, 4, 5), (6, 7), (8,))
    mgr.check_invariants()
    step(r0, 8)
    # the reserved blocks are not published: full attention serves only the 8 computed
    # tokens (the junction), and no checkpoint is saved yet, so nothing hits
    probe = mgr.make_request("probe", [*tokens(20), 1])
    hit = mgr.get_computed_blocks(probe)
    assert (hit.num_computed_tokens, hit.junction_tokens) == (0, 8)
    res = mgr.allocate_slots(r0, 8, num_reserved_tokens=4)  # covered: only the window moves
    assert res is not None and res.new_block_ids[0] == () and len(res.new_block_ids[1]) == 2
    step(r0, 8)
    res = mgr.allocate_slots(r0, 4)
    assert res is not None and res.new_block_ids[0] == ()
    step(r0, 4)
    assert mgr.get_block_ids("r0")[0] == [1, 2, 3, 4, 5]
    mgr.check_invariants()
    mgr.free("r0")
    assert mgr.get_computed_blocks(probe).num_computed_tokens == 20
    mgr.check_invariants()


def test_reserved_slots_decode_fast_path_and_refusal() -> None:
    mgr = KVCacheManager(uniform(groups(full()), 6))  # 5 usable blocks of 4 tokens
    r0 = mgr.make_request("r0", tokens(12))
    hit = mgr.get_computed_blocks(r0)
    before = mgr.snapshot()
    assert mgr.allocate_slots(r0, 4, new_computed_blocks=hit, num_reserved_tokens=20) is None
    assert mgr.snapshot() == before  # 24 tokens: 6 blocks do not fit, nothing changed
    res = mgr.allocate_slots(r0, 4, new_computed_blocks=hit, num_reserved_tokens=8)
    assert res is not None and res.new_block_ids == ((1, 2, 3),)
    step(r0, 4)
    res = mgr.allocate_slots(r0, 8, num_reserved_tokens=0)
    assert res is not None and res.new_block_ids == ((),)
    step(r0, 8)
    r0.append_token_ids([9])
    res = mgr.allocate_slots(r0, 1)  # decode past the reservation: a new block
    assert res is not None and res.new_block_ids == ((4,),)
    mgr.check_invariants()
    before = mgr.snapshot()
    with pytest.raises(RequestLengthError, match="num_reserved_tokens: must be an integer >= 0"):
        mgr.allocate_slots(r0, 0, num_reserved_tokens=-1)
    # the compiled build checks the type at the call, and reads a bool as 0 / 1
    with pytest.raises(TypeError if compiled() else RequestLengthError):
        mgr.allocate_slots(r0, 0, num_reserved_tokens=1.5)  # type: ignore[arg-type]
    if not compiled():
        with pytest.raises(RequestLengthError, match="num_reserved_tokens"):
            mgr.allocate_slots(r0, 0, num_reserved_tokens=True)
    assert mgr.snapshot() == before
    mgr.check_invariants()


def test_salt_and_lora_keep_caches_apart() -> None:
    mgr = KVCacheManager(uniform(groups(full()), 30))
    run_to_completion(mgr, mgr.make_request("a", tokens(12), cache_salt="alice"))
    run_to_completion(mgr, mgr.make_request("b", tokens(12), lora_id="adapter-1"))
    probe = [*tokens(12), 1]
    assert mgr.get_computed_blocks(mgr.make_request("x", probe)).num_computed_tokens == 0
    hit_a = mgr.get_computed_blocks(mgr.make_request("y", probe, cache_salt="alice"))
    hit_b = mgr.get_computed_blocks(mgr.make_request("z", probe, lora_id="adapter-1"))
    assert hit_a.num_computed_tokens == hit_b.num_computed_tokens == 12
    assert hit_a.blocks == ((1, 2, 3),) and hit_b.blocks == ((4, 5, 6),)
    other = mgr.make_request("w", probe, cache_salt="bob")
    assert mgr.get_computed_blocks(other).num_computed_tokens == 0


def test_reset_prefix_cache() -> None:
    layout = arena(groups(full(), swa(8)), 8)
    mgr = KVCacheManager(layout, enable_kv_events=True)
    fresh = KVCacheManager(layout).snapshot()
    r0 = mgr.make_request("r0", tokens(12))
    admit(mgr, r0)
    step(r0, 12)
    assert mgr.reset_prefix_cache() is False  # r0 holds blocks
    mgr.free("r0")
    mgr.take_events()
    assert mgr.reset_prefix_cache() is True
    assert mgr.take_events() == [AllBlocksCleared()]
    assert mgr.get_computed_blocks(mgr.make_request("r1", tokens(13))).num_computed_tokens == 0
    assert mgr.snapshot()[0] == fresh[0]
    assert mgr.stats.reset and mgr.make_prefix_cache_stats().reset
    assert not mgr.make_prefix_cache_stats().reset
    mgr.check_invariants()


@pytest.mark.parametrize("strategy", ["uniform", "pools", "arena"])
def test_not_enough_blocks_returns_none_and_changes_nothing(strategy: str) -> None:
    gs = groups(full(), swa(8), state())
    layout = {
        "uniform": lambda: uniform(gs, 32),
        "pools": lambda: pools(gs, 16),
        "arena": lambda: arena(gs, 20),
    }[strategy]()
    mgr = KVCacheManager(layout, enable_kv_events=True)
    run_to_completion(mgr, mgr.make_request("old", tokens(16)))  # cached blocks to evict
    r0 = mgr.make_request("r0", tokens(40, start=100))
    _, res = admit(mgr, r0, budget=16)
    assert res is not None
    step(r0, 16)
    r1 = mgr.make_request("r1", [*tokens(16), 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7])
    hit = mgr.get_computed_blocks(r1)
    assert hit.num_computed_tokens == 16
    before = mgr.snapshot()
    res = mgr.allocate_slots(
        r1, 17, num_new_computed_tokens=16, new_computed_blocks=hit, num_lookahead_tokens=60
    )
    assert res is None
    assert mgr.snapshot() == before
    res = mgr.allocate_slots(r0, 24, num_lookahead_tokens=100)  # releases + too many
    assert res is None
    assert mgr.snapshot() == before
    mgr.check_invariants()
    res = mgr.allocate_slots(r1, 17, num_new_computed_tokens=16, new_computed_blocks=hit)
    assert res is not None
    mgr.check_invariants()


def test_window_tail_protected_at_free_is_evicted_from_its_highest_block() -> None:
    # Window 8 on 2-token blocks: a hit at 12 needs positions [2, 6) (blocks of tokens 4..11).
    mgr = KVCacheManager(uniform(groups((swa(8), 2)), 9), hasher="builtin", enable_kv_events=True)
    r0 = mgr.make_request("r0", tokens(12))
    run_to_completion(mgr, r0)
    pos = {h: j for j, h in enumerate(r0.block_hashes)}
    pool = mgr.pool
    assert sorted(pos[h] for h in pool.maps[0]) == [1, 2, 3, 4, 5]  # tails at 11 and 12
    # The free re-ages the window before its end highest first: the lowest block, which
    # every shorter hit needs too, is the most recently used.
    assert [pos[pool.hashes[0][b]] for b in pool.core.free_cached] == [1, 5, 4, 3, 2]
    mgr.take_events()
    admit(mgr, mgr.make_request("r1", tokens(16, start=100)))  # evicts all five
    removed = [
        pos[h] for e in mgr.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes
    ]
    assert removed == [1, 5, 4, 3, 2]


def _full_arena(mode: str, lookahead: int, first: int = 0) -> tuple[KVCacheManager, list[Any]]:
    """An arena of 5 two-block chunks (full attention, state); ``r1`` takes all but a few
    blocks through lookahead, after ``r0`` (40 tokens, or ``first``) computed 3."""
    mgr = KVCacheManager(
        arena(groups(full(), state()), 6), checkpoint_admission="all", checkpoint_when_full=mode
    )
    reqs = []
    if first:
        r0 = mgr.make_request("r0", tokens(first))
        assert mgr.allocate_slots(r0, 3, new_computed_blocks=mgr.get_computed_blocks(r0))
        r0.num_computed_tokens = 3
        reqs.append(r0)
    r1 = mgr.make_request("r1", tokens(80, start=500))
    hit = mgr.get_computed_blocks(r1)
    assert mgr.allocate_slots(r1, 2, new_computed_blocks=hit, num_lookahead_tokens=lookahead)
    return mgr, reqs


@pytest.mark.parametrize("mode", ["refuse", "skip_minor", "skip"])
def test_checkpoint_when_full(mode: str) -> None:
    # r0's step to 8 needs one full-attention block (one is free) and a checkpoint slot (no
    # chunk is): at 8 of a 40-token prompt it is a minor (chunk) checkpoint
    mgr, (r0,) = _full_arena(mode, 24, first=40)
    before = mgr.snapshot()
    res = mgr.allocate_slots(r0, 5)
    if mode == "refuse":
        assert res is None and mgr.snapshot() == before
    else:  # the step runs without its checkpoint
        assert res is not None and res.new_block_ids == ((11,), ()) and res.copies_after == ()
    mgr.check_invariants()
    # the same step of a 12-token prompt ends on its last aligned point: prompt_end
    mgr, (r0,) = _full_arena(mode, 24, first=12)
    before = mgr.snapshot()
    res = mgr.allocate_slots(r0, 5)
    if mode == "skip":
        assert res is not None and res.new_block_ids == ((11,), ()) and res.copies_after == ()
    else:
        assert res is None and mgr.snapshot() == before
    # a first allocation: its running slot fits, its checkpoint does not
    mgr, _ = _full_arena(mode, 24)
    r2 = mgr.make_request("r2", tokens(40, start=900))
    hit = mgr.get_computed_blocks(r2)
    before = mgr.snapshot()
    res = mgr.allocate_slots(r2, 4, new_computed_blocks=hit)
    if mode == "skip":
        assert res is not None and res.new_block_ids == ((10,), (9,)) and res.copies_after == ()
    else:  # an admission waits rather than start without the checkpoint
        assert res is None and mgr.snapshot() == before
    mgr.check_invariants()


def test_checkpoint_when_full_defaults_by_layout() -> None:
    gs = groups(full(), state())
    managers = {
        "arena": KVCacheManager(arena(gs, 6)),
        "uniform": KVCacheManager(uniform(gs, 10)),
        "pools": KVCacheManager(pools(gs, 10)),
    }
    assert {k: m._coord.when_full for k, m in managers.items()} == {
        "arena": "skip_minor",
        "uniform": "refuse",
        "pools": "skip",
    }
    with pytest.raises(PlanError, match="checkpoint_when_full: unknown policy 'never'; valid: ref"):
        KVCacheManager(arena(gs, 6), checkpoint_when_full="never")
