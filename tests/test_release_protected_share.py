"""A free keeps every lower tier within its protected share after the checkpoint sweep too.

Regression test for commit 16ff1f6 (``HybridCoordinator.release``): with
``checkpoint_life="kv"``, ``dead_tails="drop"`` and a host tier, a free drops the request's
dead attention tails (they go down to the host) and then sweeps the state checkpoints that
ended with them (they go down too).  The protected share was enforced after the drops only,
so the swept checkpoint parts of a protected session left the host over its share
(``tiers: host keeps 2048 B of protected entries, over its limit of 1536 B``).

The layout: full attention (group 0), a 4-token sliding window (group 1) and a state group
(group 2), block size 4, 128 bytes a block or slot, one uniform pool too large to evict.
After a request frees, the window keeps only its tail block, so no checkpoint of the request
has its window cached: the longest hit its tokens have is 0, every attention block it
computed is a dead tail, and every checkpoint it saved ends with one of them.
"""

from __future__ import annotations

from hybridkv.cache import KVCacheManager, Request, TierSpec
from hybridkv.cache.tier_orders import Tier
from test_cache_factories import (
    admit,
    cached_hashes,
    full,
    groups,
    state,
    step,
    swa,
    tokens,
    uniform,
)

BB = 128  # bytes of one block (attention, window) or slot (state)


def _manager(share: float) -> tuple[KVCacheManager, Tier]:
    layout = uniform(groups(full(), swa(4), state()), 40)
    assert {g.block_bytes for g in layout.groups} == {BB}
    mgr = KVCacheManager(
        layout,
        hasher="builtin",
        tiers=[TierSpec("host", 24 * BB)],
        checkpoint_admission="all",
        checkpoint_life="kv",
        dead_tails="drop",
        protect_share=share,
    )
    tiers = mgr._coord.tiers
    assert tiers is not None and mgr._coord.coupling.active
    return mgr, tiers.tiers[0]


def _run_a(mgr: KVCacheManager) -> Request:
    """Request ``a``: 30 tokens, prefilled 8, 4, 4, 4, 4, then 6 (checkpoints at 8, 12, 16,
    20 and 24, under the hashes of its blocks 1..5; none at 30), protected as ``newer``."""
    a = mgr.make_request("a", tokens(30))
    _, res = admit(mgr, a, budget=8)
    assert res is not None
    step(a, 8)
    for n in (4, 4, 4, 4, 6):
        assert mgr.allocate_slots(a, n) is not None
        step(a, n)
    h = a.block_hashes
    assert mgr.protect("a", "newer") == 7  # blocks 0..6 (tokens 0..28)
    assert cached_hashes(mgr)[0] == set(h[:7])
    assert cached_hashes(mgr)[2] == set(h[1:6])  # the checkpoints
    return a


def test_a_free_enforces_the_share_over_the_checkpoints_its_dead_tails_end() -> None:
    # host: 24 blocks, 12 of them protected at most
    mgr, host = _manager(0.5)
    assert host.keep_limit == 12 * BB
    # b: 18 tokens in one step, no checkpoint: its 4 attention blocks are dead tails,
    # protected as "older" (4 of 12)
    b = mgr.make_request("b", tokens(18, 1000))
    assert admit(mgr, b)[1] is not None
    step(b, 18)
    assert mgr.protect("b", "older") == 4
    mgr.free("b")
    mgr.check_invariants()
    hb = b.block_hashes[:4]
    assert list(host.kept) == [(0, x) for x in hb] and not host.lru
    a = _run_a(mgr)
    ha = a.block_hashes
    mgr.free("a")
    # The drops bring a's 7 attention blocks down (11 of 12 protected: within the share),
    # the sweep its 5 checkpoints (16 of 12): "older" must end then, "newer" fits alone.
    mgr.check_invariants()
    assert host.kept_bytes == host.keep_limit == 12 * BB
    assert list(host.kept) == [*((0, x) for x in ha[:7]), *((2, x) for x in ha[1:6])]
    # the ended session's entries join the young end, its prefix's start youngest
    assert list(host.lru) == [(0, x) for x in hb[::-1]]
    assert mgr.session_stats() == {"sessions": 1, "protected_hashes": 7, "expired": 1}
    stats = mgr.tier_stats()["host"]
    assert (stats["blocks"], stats["protected_blocks"], stats["dropped"]) == (16, 12, 0)
    # the device keeps only the windows' tails
    assert cached_hashes(mgr) == [set(), {ha[6], hb[3]}, set()]


def test_a_session_the_sweep_alone_puts_over_the_share_ends_at_the_free() -> None:
    # host: 24 blocks, 9 of them protected at most: a's 7 attention blocks fit, its 12
    # entries with the checkpoints do not
    mgr, host = _manager(0.4)
    assert host.keep_limit // BB == 9
    a = _run_a(mgr)
    ha = a.block_hashes
    mgr.free("a")
    mgr.check_invariants()
    assert not host.kept and host.kept_bytes == 0
    assert mgr.session_stats() == {"sessions": 0, "protected_hashes": 0, "expired": 1}
    # every part under one hash moves together; the prefix's start joins the young end last
    steps = ((g, ha[i]) for i in range(5, 0, -1) for g in (0, 2))
    assert list(host.lru) == [(0, ha[6]), *steps, (0, ha[0])]
    assert mgr.tier_stats()["host"]["blocks"] == 12
    assert cached_hashes(mgr) == [set(), {ha[6]}, set()]
