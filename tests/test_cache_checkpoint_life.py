"""``checkpoint_life``: a recurrent-state checkpoint lives as long as the KV it ends ("kv",
the default: refreshed when its request frees its blocks, dropped with the prefix-closed
block ending where it does) or on its own ("alone": it ages from its publication)."""

from __future__ import annotations

import pytest

from hybridkv.cache import CHECKPOINT_LIFE, KVCacheManager, Request
from hybridkv.cache.events import BlockRemoved
from hybridkv.cache.kinds import StateManager
from hybridkv.cache.policies import lives_with_kv
from hybridkv.cache.tiers import TierSpec
from hybridkv.errors import PlanError
from test_cache_factories import admit, full, groups, pools, state, step, tokens, uniform


def _manager(sizes: list[int], life: str) -> KVCacheManager:
    """Full attention (group 0) and one state group (group 1), block size 4, own pools of
    ``sizes`` blocks (block 0 of each is the null block)."""
    return KVCacheManager(
        pools(groups(full(), state()), sizes),
        hasher="builtin",
        enable_kv_events=True,
        checkpoint_admission="all",
        checkpoint_life=life,
    )


def _prefill_8(mgr: KVCacheManager, rid: str, start: int, n: int = 9) -> Request:
    """An ``n``-token prompt prefilled 8 (a checkpoint at 8), then the rest in one step
    (which publishes the checkpoint, and saves none: it ends off the 4-token grid)."""
    req = mgr.make_request(rid, tokens(n, start))
    _, res = admit(mgr, req, budget=8)
    assert res is not None
    step(req, 8)
    assert mgr.allocate_slots(req, n - 8) is not None
    step(req, n - 8)
    return req


@pytest.mark.parametrize(
    ("life", "refresh_from", "kept"),
    [("kv", None, "a"), ("auto", None, "a"), ("kv", 9, "b"), ("alone", None, "b")],
)
def test_a_request_s_checkpoints_are_refreshed_when_it_frees_its_blocks(
    life: str, refresh_from: int | None, kept: str
) -> None:
    # a publishes its checkpoint at 8 first, then b publishes its own and ends; a ends last.
    # Both computed 13 tokens, so the checkpoint at their computed end's grid point (12),
    # which every free refreshes, is not theirs.  Under "kv" a's checkpoint is refreshed at
    # a's free, so b's is the older one and goes first; under "alone" (or where a checkpoint
    # is too large for the KV before it) a's, published first, goes first.
    mgr = _manager([16, 5], life)
    state_group = mgr._coord.managers[1]
    assert isinstance(state_group, StateManager)
    # a checkpoint (128 B) is refreshed where the KV before it holds twice that: 8 tokens of
    # 32 B (REFRESH_SHARE); one that must end at 9 or later is not
    assert state_group.refresh_from == (8 if lives_with_kv(life, has_tiers=False) else 0)
    if refresh_from is not None:
        state_group.refresh_from = refresh_from
    a = _prefill_8(mgr, "a", 0, 13)
    b = _prefill_8(mgr, "b", 100, 13)
    mgr.free("b")
    mgr.free("a")
    state_map = mgr._coord.pool.maps[1]
    ha, hb = a.block_hashes[1], b.block_hashes[1]
    assert {ha, hb} <= state_map.keys()
    mgr.take_events()
    # three fresh 3-token requests take a running slot each: the two free slots, then one
    # evicted checkpoint
    for i in range(3):
        _, res = admit(mgr, mgr.make_request(f"c{i}", tokens(3, 1000 + 10 * i)))
        assert res is not None
        mgr.check_invariants()
    gone = hb if kept == "a" else ha
    assert [e for e in mgr.take_events() if isinstance(e, BlockRemoved)] == [
        BlockRemoved(1, (gone,))
    ]
    start = 0 if kept == "a" else 100  # the survivor's prompt, then other tokens
    again = mgr.make_request("again", [*tokens(8, start), 7777, 7778])
    assert mgr.get_computed_blocks(again).num_computed_tokens == 8


@pytest.mark.parametrize("life", CHECKPOINT_LIFE)
def test_a_checkpoint_leaves_with_the_block_it_ends(life: str) -> None:
    # a leaves attention blocks [0, 4) and [4, 8) cached (its block [8, 12) holds one token:
    # never cached) and a checkpoint at 8, under the hash of block [4, 8).  A fresh request
    # needing the three free attention blocks and one more evicts [4, 8) (freed tail first,
    # so older than [0, 4)); under
    # "kv" the checkpoint goes with it, under "alone" it stays, though no hit can reach it.
    mgr = _manager([6, 4], life)
    a = _prefill_8(mgr, "a", 0)
    mgr.free("a")
    h4, h8 = a.block_hashes[0], a.block_hashes[1]
    pool = mgr._coord.pool
    assert h8 in pool.maps[0] and h8 in pool.maps[1]
    mgr.take_events()
    _, res = admit(mgr, mgr.make_request("x", tokens(17, 500)), budget=16)  # 4 blocks
    assert res is not None
    mgr.check_invariants()
    removed = [e for e in mgr.take_events() if isinstance(e, BlockRemoved)]
    if lives_with_kv(life, has_tiers=False):  # "kv", and "auto" without tiers
        assert removed == [BlockRemoved(0, (h8,)), BlockRemoved(1, (h8,))]
        assert h8 not in pool.maps[1]
    else:
        assert removed == [BlockRemoved(0, (h8,))]
        assert h8 in pool.maps[1]
    assert h4 in pool.maps[0]
    again = mgr.make_request("again", tokens(9, 0))
    assert mgr.get_computed_blocks(again).num_computed_tokens == 0  # [4, 8) is gone


def test_one_state_group_couples_to_attention_only_under_kv() -> None:
    layout = uniform(groups(full(), state()), 7)
    assert KVCacheManager(layout, hasher="builtin")._coord.coupling.active  # "auto": kv
    # "auto" with lower tiers: alone (kv cost hits there, docs/vllm.md); "kv" asked for: kv
    host = [TierSpec("host", 1 << 20)]
    tiered = KVCacheManager(layout, hasher="builtin", tiers=host)
    assert not tiered._coord.coupling.active
    assert [getattr(m, "refresh_from", 0) for m in tiered._coord.managers] == [0, 0]
    kv = KVCacheManager(layout, hasher="builtin", tiers=host, checkpoint_life="kv")
    assert kv._coord.coupling.active
    alone = KVCacheManager(layout, hasher="builtin", checkpoint_life="alone")
    assert not alone._coord.coupling.active
    assert not alone._coord.events.tracks_evictions  # no events, no tiers, no coupling
    state_only = KVCacheManager(uniform(groups(state()), 7), hasher="builtin")
    assert not state_only._coord.coupling.active  # nothing to couple to


def test_an_unknown_checkpoint_life_is_refused() -> None:
    with pytest.raises(
        PlanError, match=r"checkpoint_life: unknown policy 'forever'; valid: auto, kv, alone"
    ):
        KVCacheManager(uniform(groups(full(), state()), 7), checkpoint_life="forever")
