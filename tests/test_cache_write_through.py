"""Write-through to a lower tier: every block the device publishes is stored below once the
step that computes it ran (``KVCacheManager(tier_write_through=)``), exact operations."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as hst
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from hybridkv.cache import KVCacheManager, TierSpec
from hybridkv.cache.tiers import TierOp, TierStack
from hybridkv.errors import PlanError
from hybridkv.plan import MemoryLayout
from test_cache_factories import admit, full, groups, layout_for, pools, state, tokens


def _mgr(layout: MemoryLayout, through: str | None, *tiers: TierSpec) -> KVCacheManager:
    return KVCacheManager(
        layout,
        hasher="builtin",
        tiers=tiers,
        tier_ops=True,
        tier_write_through=through,
        checkpoint_admission="all",
    )


def _stores(ops: list[TierOp]) -> list[tuple[str, int, int, int]]:
    return [(op.tier, op.group_id, op.block_hash, op.block) for op in ops if op.op == "store"]


def test_published_blocks_are_stored_once_their_step_ran_and_not_again_at_eviction() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)  # 4 usable blocks
    bb = layout.groups[0].block_bytes
    mgr = _mgr(layout, "host", TierSpec("host", 8 * bb))
    req = mgr.make_request("a", tokens(13))
    _, res = admit(mgr, req)
    assert res is not None
    hashes = req.block_hashes
    # published at allocation ("scheduled"), but not stored before the step ran
    assert mgr.take_tier_ops() == []
    assert mgr.write_through() == 3
    assert _stores(mgr.take_tier_ops()) == [("host", 0, hashes[j], j + 1) for j in range(3)]
    assert mgr.write_through() == 0  # nothing new
    req.num_computed_tokens = req.num_tokens
    mgr.free("a")
    b = mgr.make_request("b", tokens(13, 100))  # evicts a's three blocks: already below
    _, res = admit(mgr, b)
    assert res is not None
    assert _stores(mgr.take_tier_ops()) == []
    assert mgr.write_through() == 3
    assert [s[2] for s in _stores(mgr.take_tier_ops())] == list(b.block_hashes[:3])
    st = mgr.tier_stats()["host"]
    assert (st["blocks"], st["stored"]) == (6, 6)
    mgr.check_invariants()


def test_without_write_through_only_evictions_go_down() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)
    bb = layout.groups[0].block_bytes
    mgr = _mgr(layout, None, TierSpec("host", 8 * bb))
    req = mgr.make_request("a", tokens(13))
    admit(mgr, req)
    assert mgr.write_through() == 0
    assert mgr.take_tier_ops() == []


def test_a_block_taken_back_before_its_step_ran_is_not_stored() -> None:
    layout = layout_for("pools", groups((full(), 8)), 8)
    bb = layout.groups[0].block_bytes
    mgr = _mgr(layout, "host", TierSpec("host", 8 * bb))
    req = mgr.make_request("a", tokens(13))
    _, res = admit(mgr, req, 8)  # the first step fills blocks 0-1 (published)
    assert res is not None
    mgr.free("a")  # preempted before that step ran: its blocks are taken back
    assert mgr.write_through() == 0
    assert _stores(mgr.take_tier_ops()) == []
    mgr.check_invariants()


def test_write_through_to_disk_skips_the_host_tier() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)
    bb = layout.groups[0].block_bytes
    mgr = _mgr(layout, "disk", TierSpec("host", 8 * bb), TierSpec("disk", 8 * bb))
    req = mgr.make_request("a", tokens(9))
    admit(mgr, req)
    assert mgr.write_through() == 2
    stores = _stores(mgr.take_tier_ops())
    assert [s[0] for s in stores] == ["disk", "disk"]
    stats = mgr.tier_stats()
    assert (stats["host"]["blocks"], stats["disk"]["blocks"]) == (0, 2)
    req.num_computed_tokens = req.num_tokens
    mgr.free("a")
    admit(mgr, mgr.make_request("b", tokens(13, 50)))  # evicts a's blocks: to the host too
    stats = mgr.tier_stats()
    assert (stats["host"]["blocks"], stats["disk"]["blocks"]) == (2, 2)  # inclusive
    mgr.check_invariants()


def test_state_checkpoints_go_through_with_their_reason() -> None:
    layout = pools(groups((full(), 4), (state(), 8)), [7, 3])  # 6 blocks, 2 state slots
    mgr = _mgr(layout, "host", TierSpec("host", 1 << 30))
    req = mgr.make_request("a", tokens(17))
    _, res = admit(mgr, req, 16)  # a first step of 16 tokens: a checkpoint at 16
    assert res is not None
    req.num_computed_tokens = 16
    assert mgr.allocate_slots(req, 1) is not None  # publishes the checkpoint (computed)
    mgr.write_through()
    ops = mgr.take_tier_ops()
    state_stores = [op for op in ops if op.op == "store" and op.group_id == 1]
    h = req.block_hashes[16 // 4 - 1]
    sm = mgr._coord.managers[1]
    assert [(op.block_hash, op.block, op.tag) for op in state_stores] == [
        (h, sm.map[h], sm.reasons[sm.map[h]])  # type: ignore[attr-defined]
    ]
    assert state_stores[0].tag != 0
    mgr.check_invariants()


def test_bad_write_through_settings_are_refused() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)
    bb = layout.groups[0].block_bytes
    with pytest.raises(PlanError, match="tier_write_through: 'host' names a tier, but"):
        KVCacheManager(layout, tier_write_through="host")
    with pytest.raises(PlanError, match=r"tier_write_through: 'disk' is not a tier .*valid: host"):
        KVCacheManager(layout, tiers=[TierSpec("host", bb)], tier_write_through="disk")


@settings(max_examples=60, deadline=None)
@given(
    hst.lists(
        hst.tuples(hst.integers(0, 3), hst.integers(1, 20), hst.booleans()), min_size=1, max_size=25
    ),
    hst.sampled_from(["host", "disk"]),
)
def test_write_through_keeps_every_tier_consistent(
    script: list[tuple[int, int, bool]], through: str
) -> None:
    """Random admissions (prompts sharing prefixes), each either computed then freed or
    taken back before its step ran, with a write-through flush after each: the invariants
    hold after every operation, every store names a block that held its hash when flushed,
    and a hash is stored into a tier at most once while the tier holds it."""
    layout = layout_for("pools", groups((full(), 6)), 6)
    bb = layout.groups[0].block_bytes
    mgr = _mgr(layout, through, TierSpec("host", 3 * bb), TierSpec("disk", 5 * bb))
    held: dict[str, set[int]] = {"host": set(), "disk": set()}
    for n, (family, length, computed) in enumerate(script):
        req = mgr.make_request(f"r{n}", tokens(length, 1000 * family))
        _, res = admit(mgr, req)
        if res is None:
            continue
        if computed:
            req.num_computed_tokens = req.num_tokens
        mgr.free(req.request_id)
        evictions = mgr.take_tier_ops()
        mgr.write_through()
        mgr.check_invariants()
        through_ops = mgr.take_tier_ops()
        maps = [m.map for m in mgr._coord.managers]
        for op in through_ops:
            if op.op == "store":  # the device block holds the hash it is stored under
                assert maps[op.group_id].get(op.block_hash) == op.block
        for op in evictions + through_ops:
            if op.op == "store":
                assert op.block_hash not in held[op.tier]
                held[op.tier].add(op.block_hash)
            elif op.op == "move":
                held[op.tier].discard(op.block_hash)
                held[op.dest].add(op.block_hash)
            elif op.op == "drop":
                held[op.tier].discard(op.block_hash)
        stats = mgr.tier_stats()
        assert {t: len(h) for t, h in held.items()} == {t: stats[t]["blocks"] for t in held}


def _ops(stack: TierStack) -> list[tuple[str, str, int]]:
    return [(op.op, op.tier, op.block_hash) for op in stack.take_ops()]


def test_cold_copies_take_only_free_or_cold_room_and_go_first() -> None:
    stack = TierStack([TierSpec("host", 4 * 10), TierSpec("disk", 100)], [10], record_ops=True)
    stack.evicted(0, (1, 2), (11, 12))  # write-back: warm
    stack.evicted(0, (3, 4), (13, 14), cold=True)  # write-through copies: cold
    assert _ops(stack) == [("store", "host", h) for h in (1, 2, 3, 4)]
    stack.evicted(0, (5,), (15,), cold=True)  # full: the oldest cold copy makes way, dropped
    assert _ops(stack) == [("drop", "host", 3), ("store", "host", 5)]
    stack.evicted(0, (6,), (16,))  # a warm entry: cold copies go first, and are not moved down
    assert _ops(stack) == [("drop", "host", 4), ("store", "host", 6)]
    host = stack.tiers[0]
    assert (list(host.cold), list(host.lru)) == ([(0, 5)], [(0, 1), (0, 2), (0, 6)])
    stack.evicted(0, (5,), (15,))  # the device evicts a block with a cold copy: it warms
    assert _ops(stack) == []
    assert (list(host.cold), list(host.lru)) == ([], [(0, 1), (0, 2), (0, 6), (0, 5)])
    stack.evicted(0, (7,), (17,), cold=True)  # all warm: no room for a cold copy
    assert _ops(stack) == [] and stack.where(0, 7) is None
    stack.evicted(0, (8,), (18,))  # warm pressure moves the oldest warm entry down
    assert _ops(stack) == [("move", "host", 1), ("store", "host", 8)]
    assert stack.where(0, 1) == "disk"
    stack.check_invariants()


def test_a_hit_or_a_refresh_warms_a_cold_copy() -> None:
    stack = TierStack([TierSpec("host", 40)], [10])
    stack.evicted(0, (1, 2), (11, 12), cold=True)
    assert stack.load_hash(0, 2) == "host"
    host = stack.tiers[0]
    assert (list(host.cold), list(host.lru)) == ([(0, 1)], [(0, 2)])
    assert stack.refresh(0, [1]) == 1
    assert (list(host.cold), list(host.lru)) == ([], [(0, 2), (0, 1)])
    assert stack.stats()["host"]["cold_blocks"] == 0
    stack.check_invariants()


@settings(max_examples=40, deadline=None)
# a hit whose entries a disk tier also holds as cold write-through copies: only the copy read
# is held during the allocation, so the copies below give way as a write-back cache's room
@example([(0, 18, True), (0, 19, False), (2, 18, True), (1, 13, True), (2, 19, False)])
@given(
    hst.lists(
        hst.tuples(hst.integers(0, 3), hst.integers(1, 24), hst.booleans()), min_size=1, max_size=30
    )
)
def test_write_through_leaves_the_warm_entries_and_hits_of_write_back(
    script: list[tuple[int, int, bool]],
) -> None:
    """On attention-only layouts the cold copies change nothing write-back decides: the same
    script gives the same hits and, tier by tier, the same warm entries in the same order."""
    layout = layout_for("pools", groups((full(), 6)), 6)
    bb = layout.groups[0].block_bytes
    specs = (TierSpec("host", 3 * bb), TierSpec("disk", 5 * bb))
    mgrs = [_mgr(layout, through, *specs) for through in (None, "host", "disk")]
    for n, (family, length, computed) in enumerate(script):
        hits = []
        for mgr in mgrs:
            req = mgr.make_request(f"r{n}", tokens(length, 1000 * family))
            hit, res = admit(mgr, req)
            hits.append(None if res is None else hit.num_computed_tokens)
            if res is not None:
                if computed:
                    req.num_computed_tokens = req.num_tokens
                mgr.free(req.request_id)
            mgr.write_through()
            mgr.check_invariants()
        assert hits[1:] == hits[:1] * 2
        warm = []
        for mgr in mgrs:
            tiers = mgr._coord.tiers
            assert tiers is not None
            warm.append([list(t.lru) for t in tiers.tiers])
        assert warm[1:] == warm[:1] * 2


class ColdTierMachine(RuleBasedStateMachine):
    """A two-tier stack (blocks of 10 and 30 bytes) under random warm and cold stores, hits,
    refreshes, discards, persists and clears: the invariants hold after every step, a cold
    store never changes any tier's warm entries, and a warm store leaves no cold copy of
    what it stored."""

    def __init__(self) -> None:
        super().__init__()
        self.stack = TierStack(
            [TierSpec("host", 90), TierSpec("disk", 150)], [10, 30], record_ops=True
        )

    def _warm(self) -> list[list[tuple[int, int]]]:
        return [list(t.lru) for t in self.stack.tiers]

    @rule(g=hst.integers(0, 1), h=hst.integers(0, 9), cold=hst.booleans(), level=hst.integers(0, 1))
    def store(self, g: int, h: int, cold: bool, level: int) -> None:
        before = self._warm()
        held = [h in t.keys[g] for t in self.stack.tiers]
        self.stack.evicted(g, (h,), (h + 1,), level=level, cold=cold)
        if cold:
            assert self._warm() == before
        else:
            assert (g, h) not in self.stack.tiers[level].cold
        if held[level] and not cold:  # a store of a held entry refreshes it
            assert list(self.stack.tiers[level].lru)[-1] == (g, h)
        self.stack.take_ops()

    @rule(g=hst.integers(0, 1), h=hst.integers(0, 9))
    def hit(self, g: int, h: int) -> None:
        name = self.stack.where(g, h)
        if name is None:
            return
        assert self.stack.load_hash(g, h) == name
        t = self.stack.named(name)
        assert list(t.lru)[-1] == (g, h) and (g, h) not in t.cold

    @rule(g=hst.integers(0, 1), hs=hst.lists(hst.integers(0, 9), max_size=4))
    def refresh(self, g: int, hs: list[int]) -> None:
        self.stack.refresh(g, hs)

    @rule(g=hst.integers(0, 1), h=hst.integers(0, 9))
    def discard(self, g: int, h: int) -> None:
        self.stack.discard(g, h)
        assert self.stack.where(g, h) is None

    @rule()
    def persist(self) -> None:
        self.stack.persist("disk", [])
        assert len(self.stack.tiers[0]) == 0 and self.stack.tiers[0].used_bytes == 0

    @rule()
    def clear(self) -> None:
        self.stack.clear()
        assert all(len(t) == 0 for t in self.stack.tiers)

    @invariant()
    def consistent(self) -> None:
        self.stack.check_invariants()
        stats = self.stack.stats()
        for t in self.stack.tiers:
            assert stats[t.name]["blocks"] == len(t.lru) + len(t.cold)
            assert stats[t.name]["cold_blocks"] == len(t.cold)


ColdTierMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
test_cold_tier_machine = ColdTierMachine.TestCase
