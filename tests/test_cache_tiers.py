"""Lower cache tiers in the manager: write-back of evictions, lookups, loads (exact ids)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as hst

from hybridkv.cache import KVCacheManager, TierLoad, TierSpec
from hybridkv.cache.admission import EXPLORE
from hybridkv.cache.errors import StaleComputedBlocksError
from hybridkv.cache.tiers import TieredMap, TierStack
from hybridkv.errors import PlanError, StorageError
from hybridkv.plan import MemoryLayout
from test_cache_factories import admit, full, groups, layout_for, pools, state, swa, tokens


def _mgr(layout: MemoryLayout, *tiers: TierSpec) -> KVCacheManager:
    return KVCacheManager(layout, hasher="builtin", tiers=tiers, checkpoint_admission="all")


def _run(
    mgr: KVCacheManager, rid: str, prompt: list[int], first: int | None = None
) -> tuple[int, tuple[TierLoad, ...]]:
    """Admit ``prompt`` (a first step of ``first`` tokens, then the rest), compute it, free
    it; returns (hit tokens, the first allocation's loads)."""
    req = mgr.make_request(rid, prompt)
    hit, res = admit(mgr, req, first)
    assert res is not None
    req.num_computed_tokens = req.num_tokens if first is None else hit.num_computed_tokens + first
    if req.num_computed_tokens < req.num_tokens:
        assert mgr.allocate_slots(req, req.num_tokens - req.num_computed_tokens) is not None
        req.num_computed_tokens = req.num_tokens
    mgr.free(rid)
    mgr.check_invariants()
    return hit.num_computed_tokens, res.loads


def test_evicted_blocks_come_back_from_the_host_tier() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)  # 4 usable blocks
    bb = layout.groups[0].block_bytes
    mgr = _mgr(layout, TierSpec("host", 6 * bb))
    assert _run(mgr, "a", tokens(13)) == (0, ())
    assert _run(mgr, "b", tokens(13, 100)) == (0, ())  # evicts a's 3 cached blocks
    assert mgr.tier_stats()["host"]["blocks"] == 3
    req = mgr.make_request("c", tokens(13))
    hit = mgr.get_computed_blocks(req)
    assert hit.num_computed_tokens == 12
    assert hit.blocks == ((-1, -1, -1),)  # read back from a tier
    res = mgr.allocate_slots(req, 1, num_new_computed_tokens=12, new_computed_blocks=hit)
    assert res is not None
    hashes = req.block_hashes
    assert res.loads == tuple(
        TierLoad(0, b, "host", hashes[j]) for j, b in zip(range(3), (1, 2, 3), strict=True)
    )
    assert mgr.get_block_ids("c") == ([1, 2, 3, 4],)
    assert res.new_block_ids == ((4,),)
    mgr.check_invariants()
    st = mgr.tier_stats()["host"]
    # b's blocks went down when c took the device blocks back; a's entries stay (inclusive).
    assert (st["blocks"], st["stored"], st["loaded"], st["dropped"]) == (6, 6, 3, 0)
    assert st["stored_bytes"] == st["from_device_bytes"] == 6 * bb  # all from the device


def test_a_full_host_tier_cascades_to_disk_and_loads_name_it() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)
    bb = layout.groups[0].block_bytes
    mgr = _mgr(layout, TierSpec("host", bb), TierSpec("disk", 2 * bb))
    _run(mgr, "a", tokens(9))  # 2 cached blocks
    _run(mgr, "b", tokens(13, 100))  # 4 blocks: evicts a's 2 (one stays in host, one -> disk)
    stats = mgr.tier_stats()
    assert (stats["host"]["blocks"], stats["disk"]["blocks"]) == (1, 1)
    assert stats["host"]["dropped"] == 1
    # both came from the device into the host tier; the disk's one was moved down from there
    assert (stats["host"]["from_device_bytes"], stats["disk"]["from_device_bytes"]) == (2 * bb, 0)
    assert stats["disk"]["stored_bytes"] == bb
    hit, loads = _run(mgr, "c", tokens(9))
    assert hit == 8
    assert sorted(load.tier for load in loads) == ["disk", "host"]


def test_a_block_larger_than_the_host_tier_goes_straight_to_disk() -> None:
    # group 0's blocks (300 B) never fit the 100 B host tier; group 1's (50 B) do
    stack = TierStack([TierSpec("host", 100), TierSpec("disk", 1000)], [300, 50])
    stack.evicted(0, (1, 2), (5, 6))
    stack.evicted(1, (9,), (4,))
    assert [len(t) for t in stack.tiers] == [1, 2]
    assert stack.where(0, 1) == "disk" and stack.where(1, 9) == "host"
    stack.evicted(0, (3, 4), (7, 8))  # disk holds 3 blocks of 300 B: the oldest is dropped
    assert stack.where(0, 1) is None
    assert stack.tiers[1].dropped == 1
    stack.check_invariants()


@pytest.mark.parametrize("name", ["host", "disk"])
def test_a_tier_that_holds_no_block_is_refused(name: str) -> None:
    with pytest.raises(
        PlanError,
        match=rf"^{name}_memory_bytes: a {name} tier of 49 B holds no block; the smallest "
        r"block here is 50 B$",
    ):
        TierStack([TierSpec(name, 49)], [300, 50])
    TierStack([TierSpec(name, 50)], [300, 50])  # one block of group 1 fits


def test_state_checkpoint_read_back_then_copied_into_the_running_slot() -> None:
    layout = pools(groups((full(), 4), (state(), 8)), [7, 3])  # 6 blocks, 2 state slots
    bbs = [g.block_bytes for g in layout.groups]
    mgr = _mgr(layout, TierSpec("host", 20 * max(bbs)))
    _run(mgr, "a", tokens(17), first=16)  # a checkpoint at 16
    _run(mgr, "b", tokens(17, 100), first=16)
    assert mgr.tier_stats()["host"]["blocks"] > 0
    req = mgr.make_request("c", tokens(17))
    hit, res = admit(mgr, req)
    assert res is not None and hit.num_computed_tokens == 16
    state_loads = [load for load in res.loads if load.group_id == 1]
    assert len(state_loads) == 1
    [load] = state_loads
    assert load.block_hash == req.block_hashes[16 // 4 - 1]
    running = mgr.get_block_ids("c")[1][0]
    assert [(c.src, c.dst) for c in res.copies_before] == [(load.block, running)]
    mgr.check_invariants()


def test_sliding_window_reads_back_only_its_window() -> None:
    layout = layout_for("pools", groups((swa(4), 4), (full(), 4)), 6)
    mgr = _mgr(layout, TierSpec("host", 40 * layout.groups[0].block_bytes))
    _run(mgr, "a", tokens(21))
    _run(mgr, "b", tokens(21, 100))
    _run(mgr, "b2", tokens(21, 200))
    req = mgr.make_request("c", tokens(21))
    hit = mgr.get_computed_blocks(req)
    assert hit.num_computed_tokens == 20
    window = hit.blocks[0]
    assert window[:4] == (0, 0, 0, 0) and window[4] != 0  # the window: the last block only
    mgr.allocate_slots(req, 1, num_new_computed_tokens=20, new_computed_blocks=hit)
    mgr.check_invariants()


def test_refused_allocation_with_a_tier_hit_changes_nothing() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)
    mgr = _mgr(layout, TierSpec("host", 8 * layout.groups[0].block_bytes))
    _run(mgr, "a", tokens(13))
    _run(mgr, "b", tokens(13, 100))
    hold = mgr.make_request("hold", tokens(9, 300))
    admit(mgr, hold)  # holds 3 of the 4 blocks
    req = mgr.make_request("c", tokens(13))
    hit = mgr.get_computed_blocks(req)
    assert hit.num_computed_tokens == 12
    before = mgr.snapshot()
    assert mgr.allocate_slots(req, 1, num_new_computed_tokens=12, new_computed_blocks=hit) is None
    assert mgr.snapshot() == before


def test_reset_clears_the_tiers() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)
    mgr = _mgr(layout, TierSpec("host", 8 * layout.groups[0].block_bytes))
    _run(mgr, "a", tokens(13))
    _run(mgr, "b", tokens(13, 100))
    assert mgr.tier_stats()["host"]["blocks"] == 3
    assert mgr.reset_prefix_cache()
    assert mgr.tier_stats()["host"]["blocks"] == 0
    assert _run(mgr, "c", tokens(13)) == (0, ())


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ([TierSpec("disk", 10), TierSpec("host", 10)], "in order host, disk"),
        ([TierSpec("host", 10), TierSpec("host", 10)], "distinct"),
    ],
)
def test_tier_stack_order(specs: list[TierSpec], match: str) -> None:
    with pytest.raises(PlanError, match=match):
        TierStack(specs, [1])


@pytest.mark.parametrize(
    ("name", "cap", "match"),
    [
        ("ssd", 10, "unknown tier 'ssd'"),
        ("host", 0, "positive byte count"),
        ("disk", True, "positive byte count"),
    ],
)
def test_tier_spec_validation(name: str, cap: int, match: str) -> None:
    with pytest.raises(PlanError, match=match):
        TierSpec(name, cap)


def test_a_checkpoint_read_back_credits_the_reason_it_was_saved_for() -> None:
    layout = pools(groups((full(), 4), (state(), 8)), [7, 3])
    mgr = KVCacheManager(
        layout,
        hasher="builtin",
        tiers=[TierSpec("host", 20 * max(g.block_bytes for g in layout.groups))],
        checkpoint_admission="yield",
    )
    _run(mgr, "a", tokens(17), first=16)  # a chunk-end checkpoint at 16
    _run(mgr, "b", tokens(17, 100), first=16)  # evicts it to the host tier
    tiers = mgr._coord.tiers
    assert tiers is not None
    req = mgr.make_request("c", tokens(17))
    h = req.block_hashes[16 // 4 - 1]
    assert tiers.where(1, h) == "host"
    reason = tiers.tag(1, h)
    before = mgr.checkpoint_admission_report()
    assert before is not None
    name = next(k for k in before if before[k]["hit_tokens"] == 0)
    hit, res = admit(mgr, req)
    assert res is not None and hit.num_computed_tokens == 16
    after = mgr.checkpoint_admission_report()
    assert after is not None
    credited = {k for k in after if after[k]["hit_tokens"] > before[k]["hit_tokens"]}
    assert len(credited) == 1 and reason != 0
    assert name in before  # the report lists every reason
    running = mgr.get_block_ids("c")[1][0]
    loaded = next(load.block for load in res.loads if load.group_id == 1)
    assert mgr._coord.managers[1].reasons[loaded] == reason  # kept on the device again
    assert [(c.src, c.dst) for c in res.copies_before] == [(loaded, running)]


def test_a_discarded_copy_is_a_miss_and_tier_blocks_name_what_loads() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)
    bb = layout.groups[0].block_bytes
    mgr = KVCacheManager(layout, hasher="builtin", tiers=(TierSpec("disk", 6 * bb),), tier_ops=True)
    _run(mgr, "a", tokens(13))
    _run(mgr, "b", tokens(13, 100))  # a's 3 blocks go to disk
    mgr.take_tier_ops()
    req = mgr.make_request("c", tokens(13))
    hit = mgr.get_computed_blocks(req)
    hashes = req.block_hashes
    assert mgr.tier_blocks(req, hit) == [(0, hashes[j], "disk") for j in range(3)]
    # storage finds the second block's copy bad: the hit stops before it
    assert mgr.discard_tier_block(0, hashes[1])
    assert not mgr.discard_tier_block(0, hashes[1])
    assert [tuple(op[:4]) for op in mgr.take_tier_ops()] == [("drop", "disk", 0, hashes[1])]
    hit = mgr.get_computed_blocks(req)
    assert (hit.num_computed_tokens, hit.blocks) == (4, ((-1,),))
    assert mgr.tier_blocks(req, hit) == [(0, hashes[0], "disk")]
    assert mgr.tier_stats()["disk"]["discarded"] == 1
    mgr.check_invariants()


def test_persist_moves_everything_cached_down_and_a_new_manager_adopts_it() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)
    bb = layout.groups[0].block_bytes
    specs = (TierSpec("host", 2 * bb), TierSpec("disk", 8 * bb))
    mgr = KVCacheManager(layout, hasher="builtin", tiers=specs, tier_ops=True)
    _run(mgr, "a", tokens(13))
    _run(mgr, "b", tokens(13, 100))  # a's 3 blocks: 2 in host, 1 cascaded to disk
    mgr.take_tier_ops()
    mgr.persist_to_tier("disk")
    ops = [op.op for op in mgr.take_tier_ops()]
    assert ops == ["move", "move", "store", "store", "store"]  # host entries, then b's blocks
    st = mgr.tier_stats()
    assert (st["host"]["blocks"], st["disk"]["blocks"]) == (0, 6)
    mgr.check_invariants()
    tiers = mgr._coord.tiers
    assert tiers is not None
    held = [(g, h, 0) for g, h in tiers.tiers[1].lru]
    fresh = KVCacheManager(layout, hasher="builtin", tiers=specs)
    # the new manager adopts them oldest first; a repeat is refused
    assert fresh.adopt_tier_entries("disk", [*held, held[0]]) == list(range(6))
    assert fresh.tier_stats()["disk"]["adopted"] == 6
    assert _run(fresh, "c", tokens(13))[0] == 12  # a's prefix, from disk
    with pytest.raises(PlanError, match="no 'ssd' tier"):
        fresh.adopt_tier_entries("ssd", [])
    before = fresh.snapshot()
    other = [(g, h + 1, 0) for g, h, _ in held]  # storage left more, then a broken entry
    with pytest.raises(StorageError, match=r"entry 6 is \('x', 1, 0\), not \(group, hash"):
        fresh.adopt_tier_entries("disk", [*other, ("x", 1, 0)])  # type: ignore[list-item]
    assert fresh.snapshot() == before  # nothing adopted
    with pytest.raises(PlanError, match="no lower tiers"):
        KVCacheManager(layout).persist_to_tier()


@pytest.mark.parametrize(
    ("policy", "disk", "where"),
    [
        ("yield", False, None),
        ("yield", True, "disk"),
        ("all", False, "host"),
        ("all", True, "host"),
    ],
)
def test_tier_admission_keeps_checkpoints_of_rejected_reasons_out_of_the_host_tier(
    policy: str, disk: bool, where: str | None
) -> None:
    layout = pools(groups((full(), 4), (state(), 8)), [7, 3])
    size = 20 * max(g.block_bytes for g in layout.groups)
    mgr = KVCacheManager(
        layout,
        hasher="builtin",
        tiers=[TierSpec("host", size), *([TierSpec("disk", size)] if disk else [])],
        checkpoint_admission="yield",
        tier_admission=policy,
    )
    _run(mgr, "a", tokens(17, 7), first=16)  # a checkpoint at 16 (saved: nothing judged yet)
    h = mgr.make_request("probe", tokens(17, 7)).block_hashes[16 // 4 - 1]
    sm = mgr._coord.managers[1]
    reason = sm.reasons[sm.map[h]]  # type: ignore[attr-defined]
    assert reason and h % EXPLORE  # not one of the explored hashes
    adm = mgr._coord.admission
    assert adm is not None
    # as after a turnover in which this reason's checkpoints served nothing
    adm.warm = True
    adm.checkpoints[reason] = adm.min_checkpoints
    adm.total_hits, adm.hit_tokens[reason] = 100, 0
    assert not adm.admits(reason, h)
    # two requests running at once take both usable state slots: a's checkpoint is evicted
    for rid, start in (("b", 100), ("c", 200)):
        _, res = admit(mgr, mgr.make_request(rid, tokens(17, start)), 4)
        assert res is not None
    tiers = mgr._coord.tiers
    assert tiers is not None and h not in sm.map  # type: ignore[attr-defined]
    assert tiers.where(1, h) == where
    mgr.check_invariants()


def test_tier_admission_rejects_unknown_policies() -> None:
    layout = pools(groups((full(), 4), (state(), 8)), [7, 3])
    with pytest.raises(PlanError, match="tier_admission: unknown policy 'some'; valid: yield, all"):
        KVCacheManager(layout, tier_admission="some")


def test_tier_refresh_moves_entries_to_the_young_end_of_the_top_tier_holding_them() -> None:
    stack = TierStack([TierSpec("host", 4), TierSpec("disk", 8)], [1, 1])
    stack.evicted(0, (1, 2, 3, 4), (1, 2, 3, 4))
    stack.evicted(0, (5,), (5,))  # host full: 1 goes down to disk
    stack.evicted(1, (9,), (6,))  # and 2
    assert stack.refresh(0, (1, 3, 77)) == 2  # 77: no tier holds it
    assert stack.snapshot() == (
        ("host", ((0, 4), (0, 5), (1, 9), (0, 3)), 4),
        ("disk", ((0, 2), (0, 1)), 2),
    )
    stack.check_invariants()


def _retained(retain: bool) -> tuple[int, int, tuple[object, ...]]:
    """Request c queues for a's prefix, which is in the host tier; two more requests run
    before it is admitted and push 3 blocks out of the 6-block host tier.  Returns c's hit,
    what ``retain_hit`` moved, and the host tier's order right after it."""
    layout = layout_for("pools", groups((full(), 4)), 4)  # 4 usable device blocks
    bb = layout.groups[0].block_bytes
    mgr = _mgr(layout, TierSpec("host", 6 * bb))
    _run(mgr, "a", tokens(13))  # a's 3 full blocks cached on the device
    _run(mgr, "b", tokens(13, 100))  # a's 3 go down to the host tier
    _run(mgr, "d", tokens(13, 200))  # b's 3 too: the host tier is full, a's the oldest
    c = mgr.make_request("c", tokens(13))
    moved = mgr.retain_hit(c) if retain else 0
    tiers = mgr._coord.tiers
    assert tiers is not None
    order = tiers.snapshot()[0][1]
    _run(mgr, "e", tokens(13, 300))  # d's 3 go down: the 3 oldest host entries are dropped
    return mgr.get_computed_blocks(c).num_computed_tokens, moved, order


def test_a_queued_request_keeps_its_host_tier_hit_through_the_wait() -> None:
    a = tokens(13)
    hashes = (
        KVCacheManager(layout_for("pools", groups((full(), 4)), 4), hasher="builtin")
        .make_request("x", a)
        .block_hashes
    )
    hit, moved, order = _retained(True)
    assert (hit, moved) == (12, 3)
    # a's entries are the youngest, the prefix's start last of all (evicted last)
    assert order[3:] == ((0, hashes[2]), (0, hashes[1]), (0, hashes[0]))
    hit, moved, order = _retained(False)
    assert (hit, moved) == (0, 0)  # the wait cost the hit
    # as the device evicted them (tail first), and the oldest of the tier
    assert order[:3] == ((0, hashes[2]), (0, hashes[1]), (0, hashes[0]))


def test_retain_hit_without_tiers_or_without_a_hit_moves_nothing() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)
    mgr = _mgr(layout)
    _run(mgr, "a", tokens(13))
    req = mgr.make_request("c", tokens(13))
    assert mgr.retain_hit(req) == 0
    assert mgr.get_computed_blocks(req).num_computed_tokens == 12
    bb = layout.groups[0].block_bytes
    tiered = _mgr(layout, TierSpec("host", 6 * bb))
    _run(tiered, "a", tokens(13))  # cached on the device only: nothing to refresh
    before = tiered.snapshot()
    assert tiered.retain_hit(tiered.make_request("c", tokens(13))) == 0
    assert tiered.retain_hit(tiered.make_request("z", tokens(13, 500))) == 0
    assert tiered.snapshot() == before


def test_tiered_map_flags_mark_hashes_on_the_device_or_in_any_tier() -> None:
    view = TieredMap({1: 5, 2: 6}, [{3: 0}, {4: 0, 1: 0}])
    assert view.flags([1, 2, 3, 4, 5, 9]) == bytes([1, 1, 1, 1, 0, 0])
    assert view.flags([1, 2]) == b"\x01\x01"  # all on the device: no tier pass
    assert view.flags([]) == b""
    assert [view.get(h) for h in (1, 3, 5)] == [5, -1, None]


@given(
    device=hst.sets(hst.integers(0, 40)),
    lower=hst.lists(hst.sets(hst.integers(0, 40)), max_size=2),
    hashes=hst.lists(hst.integers(0, 40), max_size=300),
)
def test_tiered_map_flags_agree_with_membership(
    device: set[int], lower: list[set[int]], hashes: list[int]
) -> None:
    view = TieredMap(dict.fromkeys(device, 1), [dict.fromkeys(s, 0) for s in lower])
    assert view.flags(hashes) == bytes(h in view for h in hashes)


def test_a_hit_whose_tier_entries_were_dropped_meanwhile_is_refused_changing_nothing() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)  # 4 usable blocks
    bb = layout.groups[0].block_bytes
    mgr = _mgr(layout, TierSpec("host", 3 * bb))
    _run(mgr, "a", tokens(13))
    _run(mgr, "b", tokens(13, 100))  # a's 3 blocks go to the host tier
    req = mgr.make_request("c", tokens(13))
    hit = mgr.get_computed_blocks(req)
    assert (hit.num_computed_tokens, hit.blocks) == (12, ((-1, -1, -1),))
    _run(mgr, "d", tokens(13, 200))  # b's blocks push a's out of the host tier
    assert mgr.get_computed_blocks(req).num_computed_tokens == 0
    before = mgr.snapshot()
    with pytest.raises(StaleComputedBlocksError):
        mgr.allocate_slots(req, 1, num_new_computed_tokens=12, new_computed_blocks=hit)
    assert mgr.snapshot() == before
    mgr.check_invariants()
    assert not mgr.has_blocks("c")


def test_the_tier_rules_follow_the_coordinator_s_admission() -> None:
    layout = layout_for("uniform", groups((full(), 2), (state(), 2)), 16)
    mgr = KVCacheManager(layout, hasher="builtin", tiers=[TierSpec("host", 1 << 30)])
    coord = mgr._coord
    assert coord.bridge is not None and coord.admission is not None
    assert coord.bridge.admission is coord.admission
    coord.admission = None
    assert coord.bridge.admission is None
