"""Protected sessions in the lower tiers: exact eviction orders, the manager's and the
scheduler's calls, where a protected checkpoint goes, and the workload oracle."""

from __future__ import annotations

import pytest

from hybridkv.cache import KVCacheManager, TierSpec, compiled
from hybridkv.cache.admission import PROMPT_END, CheckpointAdmission
from hybridkv.cache.errors import UnknownRequestError
from hybridkv.cache.tier_sessions import TierSessions
from hybridkv.cache.tiers import TierStack
from hybridkv.errors import InvariantError, PlanError
from hybridkv.scheduler import Scheduler, SchedulerConfig
from hybridkv.workloads import WorkloadRequest
from hybridkv.workloads.sessions import Continuation, continuations
from hybridkv.workloads.types import WorkloadError
from test_cache_factories import admit, full, groups, layout_for, pools, state, tokens


def _stack(blocks: int = 3) -> tuple[TierStack, TierSessions]:
    stack = TierStack([TierSpec("host", 10 * blocks)], [10])
    return stack, TierSessions(stack)


def _order(stack: TierStack) -> list[int]:
    """The host tier's hashes in eviction order (cold, warm, protected)."""
    t = stack.tiers[0]
    return [h for _, h in (*t.cold, *t.lru, *t.kept)]


def _check(stack: TierStack, sessions: TierSessions) -> None:
    stack.check_invariants()
    sessions.check_invariants()


def test_protected_entries_are_evicted_after_every_other_entry() -> None:
    stack, sessions = _stack(3)
    stack.evicted(0, (1, 2, 3), (7, 8, 9))
    sessions.protect("chat", [1])
    assert _order(stack) == [2, 3, 1]
    _check(stack, sessions)
    stack.evicted(0, (4, 5), (7, 8))  # two more: 2 and 3 go, 1 stays though it is oldest
    assert _order(stack) == [4, 5, 1]
    assert stack.tiers[0].dropped == 2
    stack.evicted(0, (6,), (9,))
    assert _order(stack) == [5, 6, 1]
    assert stack.stats()["host"]["protected_blocks"] == 1
    _check(stack, sessions)


def test_a_tier_of_protected_entries_evicts_the_oldest_of_them() -> None:
    stack, sessions = _stack(2)
    sessions.protect("a", [1, 2, 3])  # protected before any of them reached the tier
    stack.evicted(0, (1, 2), (7, 8))
    assert _order(stack) == [1, 2]
    stack.evicted(0, (3,), (9,))
    assert _order(stack) == [2, 3]
    _check(stack, sessions)


def test_an_entry_facing_only_protected_ones_goes_down_a_tier_or_is_dropped() -> None:
    stack = TierStack([TierSpec("host", 20), TierSpec("disk", 10)], [10], record_ops=True)
    sessions = TierSessions(stack)
    sessions.protect("s", [1, 2])
    stack.evicted(0, (1, 2), (5, 6))
    stack.evicted(0, (3,), (7,))  # the host holds only protected entries: 3 goes to disk
    assert [h for _, h in stack.tiers[0].kept] == [1, 2]
    assert [h for _, h in stack.tiers[1].lru] == [3]
    stack.evicted(0, (4,), (8,))  # the disk takes 4 in 3's place (3 is not protected)
    assert [h for _, h in stack.tiers[1].lru] == [4]
    assert [op.op for op in stack.take_ops()] == ["store", "store", "store", "drop", "store"]
    _check(stack, sessions)


def test_entries_a_hit_reads_are_held_out_of_the_eviction_orders_until_unpinned() -> None:
    stack, sessions = _stack(3)
    stack.evicted(0, (1, 2, 3), (5, 6, 7))
    stack.pin(0, 1)  # an allocation reads 1 back; its evictions write 4 first
    stack.evicted(0, (4,), (8,))
    assert _order(stack) == [3, 4] and stack.tiers[0].held == {(0, 1): 1}
    with pytest.raises(InvariantError, match="1 entries pinned between allocations"):
        stack.check_invariants()
    stack.unpin()
    assert _order(stack) == [3, 4, 1]  # back at the young end
    for h in (3, 4, 1):
        stack.pin(0, h)
    stack.evicted(0, (9,), (9,))  # every entry is being read: 9 finds no room
    assert _order(stack) == [] and stack.where(0, 9) is None
    stack.unpin()
    assert _order(stack) == [3, 4, 1]
    _check(stack, sessions)


def test_protecting_a_session_again_replaces_its_prefix() -> None:
    stack, sessions = _stack(4)
    stack.evicted(0, (1, 2, 3, 4), (5, 6, 7, 8))
    sessions.protect("chat", [1, 2])
    assert _order(stack) == [3, 4, 1, 2]
    sessions.protect("chat", [1, 3])  # the next turn: 1 stays, 3 joins, 2 is let go
    # 2 goes to the evict-first end of the warm entries; 3 joins the protected ones
    assert _order(stack) == [2, 4, 1, 3]
    assert sessions.sessions == {"chat": [1, 3]}
    _check(stack, sessions)


def test_a_hash_two_sessions_protect_stays_protected_until_both_let_go() -> None:
    stack, sessions = _stack(3)
    stack.evicted(0, (1, 2, 3), (5, 6, 7))
    sessions.protect("a", [1, 2])
    sessions.protect("b", [1])  # a shared system prompt
    assert sessions.counts == {1: 2, 2: 1}
    assert sessions.unprotect("a")
    assert _order(stack) == [2, 3, 1]
    assert sessions.counts == {1: 1}
    assert sessions.unprotect("b")
    assert not sessions.unprotect("b")
    assert _order(stack) == [1, 2, 3]
    assert sessions.counts == {} and stack.protected == {}
    _check(stack, sessions)


def test_refresh_keeps_a_protected_entry_in_its_order_and_cold_copies_stay_cold() -> None:
    stack, sessions = _stack(4)
    stack.evicted(0, (1, 2, 3), (5, 6, 7))
    stack.evicted(0, (4,), (8,), cold=True)  # a write-through copy the device still holds
    sessions.protect("s", [1, 2, 4])
    assert _order(stack) == [4, 3, 1, 2]  # the cold copy is still evicted first
    stack.refresh(0, [1])
    assert _order(stack) == [4, 3, 2, 1]
    stack.evicted(0, (4,), (8,))  # the device evicts it: it warms, into the protected order
    assert _order(stack) == [3, 2, 1, 4]
    _check(stack, sessions)


def test_a_disk_tier_keeps_protected_entries_the_host_moves_down() -> None:
    stack = TierStack([TierSpec("host", 20), TierSpec("disk", 20)], [10])
    sessions = TierSessions(stack)
    sessions.protect("s", [1])
    stack.evicted(0, (1, 2, 3, 4), (5, 6, 7, 8))
    host, disk = ([h for _, h in (*t.lru, *t.kept)] for t in stack.tiers)
    assert host == [4, 1]  # 1 protected: 2 and 3 went down instead
    assert disk == [2, 3]
    stack.evicted(0, (5,), (9,))  # the host must evict: 4, then the disk drops 2
    assert [h for _, h in (*stack.tiers[0].lru, *stack.tiers[0].kept)] == [5, 1]
    assert [h for _, h in stack.tiers[1].lru] == [3, 4]
    _check(stack, sessions)


def test_the_invariants_catch_an_entry_in_the_wrong_order() -> None:
    stack, sessions = _stack(2)
    stack.evicted(0, (1, 2), (5, 6))
    sessions.protect("s", [1])
    t = stack.tiers[0]
    del t.kept[(0, 1)]
    t.lru[(0, 1)] = None  # a protected hash in the plain order
    with pytest.raises(InvariantError, match="warm, cold and protected orders differ"):
        stack.check_invariants()
    sessions.counts[9] = 1  # a count no session holds
    with pytest.raises(InvariantError, match="1 sessions hold 1"):
        sessions.check_invariants()


def _mgr(layout, *tiers: TierSpec, admission: str = "all", share: float = 1.0) -> KVCacheManager:
    return KVCacheManager(
        layout, hasher="builtin", tiers=tiers, checkpoint_admission=admission, protect_share=share
    )


def _compute(mgr: KVCacheManager, rid: str, prompt: list[int]):
    req = mgr.make_request(rid, prompt)
    hit, res = admit(mgr, req)
    assert res is not None
    req.num_computed_tokens = req.num_tokens
    return req, hit.num_computed_tokens


def test_manager_protects_a_live_request_and_its_blocks_outlast_others_in_the_host() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)  # 4 usable blocks of 4 tokens
    bb = layout.groups[0].block_bytes
    mgr = _mgr(layout, TierSpec("host", 3 * bb))
    before = mgr.snapshot()
    with pytest.raises(UnknownRequestError, match="protect: no live request has id 'x'"):
        mgr.protect("x", "chat")
    assert mgr.snapshot() == before
    a, _ = _compute(mgr, "a", tokens(9))  # 2 whole blocks computed
    assert mgr.protect("a", "chat") == 2
    mgr.free("a")
    mgr.check_invariants()
    for n, start in enumerate((100, 200)):  # 2 x 2 more blocks: a's go down, then others
        _compute(mgr, f"b{n}", tokens(9, start))
        mgr.free(f"b{n}")
        mgr.check_invariants()
    host = mgr._coord.tiers.tiers[0]  # type: ignore[union-attr]
    # the device evicts a prefix from its end, so its start is the youngest entry
    assert [h for _, h in host.kept] == a.block_hashes[1::-1]
    assert len(host.lru) == 1  # one of b0's blocks; the other was dropped, not a's
    assert mgr.tier_stats()["host"]["protected_blocks"] == 2
    _, hit = _compute(mgr, "c", tokens(9))
    assert hit == 8  # the conversation's next turn reads a's prefix back
    assert mgr.unprotect("chat") and not mgr.unprotect("chat")
    mgr.check_invariants()


def _capped(blocks: int, share: float) -> tuple[TierStack, TierSessions]:
    stack = TierStack([TierSpec("host", 10 * blocks)], [10], protect_share=share)
    return stack, TierSessions(stack)


def test_past_the_protect_share_the_least_recently_protected_session_ends() -> None:
    stack, sessions = _capped(4, 0.5)  # protected entries may fill 20 of 40 bytes
    assert stack.tiers[0].keep_limit == 20
    stack.evicted(0, (1, 2, 3, 4), (5, 6, 7, 8))
    sessions.protect("a", [1, 2])
    assert sessions.enforce() == 0 and _order(stack) == [3, 4, 1, 2]
    sessions.protect("b", [3])  # 30 bytes protected: "a", the older, ends
    assert stack.over_limit()
    assert sessions.enforce() == 1 and not stack.over_limit()
    assert list(sessions.sessions) == ["b"] and sessions.expired == 1
    assert _order(stack) == [4, 2, 1, 3]  # a's prefix joins the young end, its start last
    assert stack.stats()["host"]["protected_bytes"] == 10
    _check(stack, sessions)
    sessions.protect("a", [1])  # protecting again makes a session the youngest
    sessions.protect("b", [3, 4])
    assert sessions.enforce() == 1 and list(sessions.sessions) == ["b"]
    _check(stack, sessions)


def test_a_session_over_the_share_by_itself_ends_and_shared_hashes_stay() -> None:
    stack, sessions = _capped(4, 0.5)
    stack.evicted(0, (1, 2, 3, 4), (5, 6, 7, 8))
    sessions.protect("big", [1, 2, 3])
    assert sessions.enforce() == 1 and not sessions.sessions
    assert stack.tiers[0].kept_bytes == 0 and not sessions.unprotect("big")
    sessions.protect("a", [1, 2])
    sessions.protect("b", [2, 3])  # 1, 2, 3: "a" ends, 2 stays for "b"
    assert sessions.enforce() == 1
    assert sessions.counts == {2: 1, 3: 1} and _order(stack) == [4, 1, 2, 3]
    _check(stack, sessions)


def test_a_session_alone_over_a_limit_ends_without_taking_the_others_along() -> None:
    stack, sessions = _capped(10, 0.5)  # 50 of 100 bytes
    stack.evicted(0, tuple(range(1, 11)), tuple(range(10)))
    for name, h in (("a", 1), ("b", 2), ("c", 3)):
        sessions.protect(name, [h])
    sessions.protect("big", [4, 5, 6, 7, 8, 9])  # 60 bytes by itself
    assert sessions.enforce("big") == 1 and list(sessions.sessions) == ["a", "b", "c"]
    _check(stack, sessions)
    hashes = TierSessions(TierStack([TierSpec("host", 100)], [10]), hash_limit=5)
    hashes.protect("a", [1])
    hashes.protect("big", list(range(10, 16)))  # 6 hashes by itself
    assert hashes.enforce("big") == 1 and list(hashes.sessions) == ["a"]


def test_only_sessions_that_free_something_where_a_limit_is_passed_end() -> None:
    stack = TierStack([TierSpec("host", 40), TierSpec("disk", 40)], [10], protect_share=0.5)
    sessions = TierSessions(stack)
    stack.evicted(0, (1, 2), (0, 0))
    stack.evicted(0, (3, 4, 5), (0, 0, 0), level=1)
    sessions.protect("h1", [1])
    sessions.protect("h2", [2])
    sessions.protect("d", [3, 4, 5])  # the disk tier is over its 20 bytes, the host is not
    sessions.protect("shared", [1])  # 1 is h1's too: ending it would free nothing
    assert sessions.enforce() == 1 and list(sessions.sessions) == ["h1", "h2", "shared"]
    _check(stack, sessions)


def test_protected_entries_the_device_brings_down_count_against_the_share() -> None:
    stack, sessions = _capped(4, 0.5)
    sessions.protect("a", [5, 6])  # none in the tier yet
    sessions.protect("b", [7])
    stack.evicted(0, (5, 6, 7), (1, 2, 3))
    assert stack.over_limit()
    with pytest.raises(InvariantError, match="over its limit of 20 B"):
        stack.check_invariants()
    assert sessions.enforce() == 1 and list(sessions.sessions) == ["b"]
    _check(stack, sessions)


def test_sessions_protecting_more_hashes_than_could_ever_be_held_end_too() -> None:
    # a client that never lets go: its entries have long left the tiers, its hashes stay
    stack = TierStack([TierSpec("host", 40)], [10])
    sessions = TierSessions(stack, hash_limit=3)
    sessions.protect("a", [1, 2])
    sessions.protect("b", [2, 3])
    assert sessions.enforce() == 0  # 3 distinct hashes, none in the tier
    sessions.protect("c", [4])
    with pytest.raises(InvariantError, match="4 protected hashes, over the limit of 3"):
        sessions.check_invariants()
    assert sessions.enforce() == 1 and list(sessions.sessions) == ["b", "c"]
    assert sessions.counts == {2: 1, 3: 1, 4: 1}
    _check(stack, sessions)


def test_the_managers_hash_limit_is_what_the_device_and_the_tiers_share_could_hold() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)
    bb = layout.groups[0].block_bytes  # one hash per block (4 tokens)
    mgr = _mgr(layout, TierSpec("host", 10 * bb), share=0.5)
    assert mgr._coord.sessions.hash_limit == (layout.total_bytes + 5 * bb) // bb
    assert _mgr(layout)._coord.sessions.hash_limit is None  # no tiers: nothing to bound


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.5, float("nan"), True, "half", None])
def test_a_bad_protect_share_is_refused_naming_it(bad: object) -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)
    if compiled() and not isinstance(bad, int | float):
        with pytest.raises(TypeError, match="float object expected"):  # typed at the call
            KVCacheManager(layout, protect_share=bad)  # type: ignore[arg-type]
        return
    if compiled() and bad is True:  # the compiled build reads it as 1.0 (setup.py)
        mgr = KVCacheManager(layout, tiers=(TierSpec("host", 1 << 20),), protect_share=bad)
        assert mgr._coord.tiers is not None
        assert mgr._coord.tiers.tiers[0].keep_limit == 1 << 20
        return
    for tiers in ((), (TierSpec("host", 1 << 20),)):
        with pytest.raises(PlanError, match=r"protect_share: .* in \(0, 1\], got"):
            KVCacheManager(layout, tiers=tiers, protect_share=bad)  # type: ignore[arg-type]


def test_the_manager_ends_a_session_its_allocation_brought_over_the_share() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)  # 4 usable blocks of 4 tokens
    bb = layout.groups[0].block_bytes
    mgr = _mgr(layout, TierSpec("host", 3 * bb), share=0.5)  # protected: 1 block at most
    assert mgr.session_stats() == {"sessions": 0, "protected_hashes": 0, "expired": 0}
    _compute(mgr, "a", tokens(9))
    assert mgr.protect("a", "chat") == 2  # a's blocks are on the device: nothing counts yet
    mgr.free("a")
    assert mgr.session_stats() == {"sessions": 1, "protected_hashes": 2, "expired": 0}
    _compute(mgr, "b0", tokens(9, 100))  # evicts one of a's blocks: within the share
    assert mgr.tier_stats()["host"]["protected_blocks"] == 1
    assert mgr.session_stats()["expired"] == 0
    mgr.free("b0")
    _compute(mgr, "b1", tokens(9, 200))  # and the other: over the share
    assert mgr.session_stats() == {"sessions": 0, "protected_hashes": 0, "expired": 1}
    assert mgr.tier_stats()["host"]["protected_blocks"] == 0
    mgr.check_invariants()
    assert not mgr.unprotect("chat")


def test_without_lower_tiers_a_session_is_recorded_and_changes_nothing_else() -> None:
    layout = layout_for("pools", groups((full(), 4)), 4)
    mgr = _mgr(layout)
    _compute(mgr, "a", tokens(9))
    pool = mgr.pool.snapshot()
    assert mgr.protect("a", "s") == 2
    assert mgr.pool.snapshot() == pool
    mgr.check_invariants()
    assert mgr.unprotect("s")


class _Refusing(CheckpointAdmission):
    """Admits every checkpoint but those of the reasons in ``refused``."""

    refused: frozenset[int] = frozenset()

    def admits(self, reason: int, block_hash: int) -> bool:
        return reason not in self.refused


def _chunked(mgr: KVCacheManager, rid: str, prompt: list[int]):
    """Compute ``prompt`` in a chunk of 16 tokens (a checkpoint there), then the rest."""
    req = mgr.make_request(rid, prompt)
    _, res = admit(mgr, req, 16)
    assert res is not None
    req.num_computed_tokens = 16
    assert mgr.allocate_slots(req, len(prompt) - 16) is not None
    req.num_computed_tokens = len(prompt)
    return req


def test_a_protected_checkpoint_the_yield_rule_would_drop_goes_to_the_host_tier() -> None:
    layout = pools(groups((full(), 4), (state(), 8)), [12, 3])  # 2 state slots
    for protect, expected in ((False, None), (True, "host")):
        mgr = _mgr(layout, TierSpec("host", 1 << 20), admission="yield")
        adm = _Refusing(1 << 30)
        mgr._coord.admission = adm
        mgr._coord.bridge.admission = adm  # type: ignore[union-attr]
        for m in mgr._coord.managers:
            m.admission = adm
        a = _chunked(mgr, "a", tokens(17))  # a checkpoint at 16, its prompt's end
        if protect:
            mgr.protect("a", "chat")
        mgr.free("a")
        h = a.block_hashes[3]  # the checkpoint at 16 (state blocks of 8 tokens)
        assert h in mgr._coord.managers[1].map
        adm.refused = frozenset({PROMPT_END})  # the yield rule now refuses a's reason
        _chunked(mgr, "b", tokens(25, 100))  # its checkpoint at 16 evicts a's
        mgr.free("b")
        assert h not in mgr._coord.managers[1].map
        assert mgr._coord.tiers.where(1, h) == expected  # type: ignore[union-attr]
        mgr.check_invariants()


def test_the_scheduler_protects_a_finished_request_under_its_session() -> None:
    layout = layout_for("pools", groups((full(), 4)), 16)
    bb = layout.groups[0].block_bytes
    mgr = _mgr(layout, TierSpec("host", 8 * bb))
    sched = Scheduler(mgr, SchedulerConfig(token_budget=64), max_model_len=64)
    sched.add_request("a", tokens(10), max_tokens=1, protect_as="chat")
    assert mgr._known == {}
    out = sched.schedule()
    sched.update(out, {"a": 999})
    sessions = mgr._coord.sessions
    assert list(sessions.sessions) == ["chat"]
    assert len(sessions.sessions["chat"]) == 2  # the 10 computed tokens' 2 whole blocks
    mgr.check_invariants()


def _req(rid: str, prompt: list[int], out: list[int]) -> WorkloadRequest:
    return WorkloadRequest(rid, 0.0, tuple(prompt), tuple(out))


def _cat(*parts: tuple[int, ...] | list[int]) -> list[int]:
    return [t for p in parts for t in p]


def test_continuations_find_each_requests_successor_and_session() -> None:
    sys_prompt = tokens(8, 1000)
    a = _req("a", sys_prompt + tokens(8), tokens(4, 50))
    b = _req("b", sys_prompt + tokens(8, 100), [7])  # shares only the system prompt
    a2 = _req("a2", _cat(a.prompt_token_ids, a.output_token_ids, tokens(4, 60)), [8])
    c = _req("c", sys_prompt + tokens(5, 300), [9])
    a3 = _req("a3", _cat(a2.prompt_token_ids, [1, 2, 3, 4]), [5])
    got = continuations([a, b, a2, c, a3], block_size=4)
    assert got == {
        "a": Continuation("a", "a2"),
        "b": Continuation("b", None),
        "a2": Continuation("a", "a3"),
        "c": Continuation("c", None),
        "a3": Continuation("a", None),
    }
    with pytest.raises(WorkloadError, match="block_size must be >= 1, got 0"):
        continuations([a], block_size=0)
    with pytest.raises(WorkloadError, match="request id 'a' repeats"):
        continuations([a, a])
    with pytest.raises(WorkloadError, match="source_block must be >= 1, got 0"):
        continuations([a], source_block=0)


def test_a_shared_system_prompt_does_not_link_strangers_to_its_first_reader() -> None:
    # the system prompt is most of "a"'s prompt, and two strangers read it and leave at the
    # same block: a shared start, not "a"'s history (found by review: the first stranger took
    # "a"'s successor slot, so its real next turn was missed)
    sys_prompt = tokens(12, 1000)
    a = _req("a", sys_prompt + tokens(4), tokens(4, 50))
    b = _req("b", sys_prompt + tokens(4, 100), [7])
    c = _req("c", sys_prompt + tokens(4, 200), [8])
    a2 = _req("a2", _cat(a.prompt_token_ids, a.output_token_ids, tokens(4, 60)), [9])
    got = continuations([a, b, c, a2], block_size=4)
    assert {rid: x.successor for rid, x in got.items()} == {
        "a": "a2",
        "b": None,
        "c": None,
        "a2": None,
    }
    # with only one stranger nothing tells it from a second question on the same text: linked
    got = continuations([a, b, a2], block_size=4)
    assert got["a"] == Continuation("a", "b") and got["b"] == Continuation("a", None)


def test_two_turns_that_read_the_whole_prompt_link_the_first() -> None:
    # "a" continued twice (a regenerated answer): both read all of "a", the first is linked
    a = _req("a", tokens(16), tokens(4, 50))
    x = _req("x", _cat(a.prompt_token_ids, tokens(4, 60)), [1])
    y = _req("y", _cat(a.prompt_token_ids, tokens(4, 70)), [2])
    got = continuations([a, x, y], block_size=4)
    assert [got[r].successor for r in "axy"] == ["x", None, None]


def test_a_source_that_cuts_the_last_block_short_still_links_the_next_turn() -> None:
    # a Mooncake-style trace knows prefixes at 8-token blocks: "a"'s last 6 tokens are a cut
    # block the next turns cannot match, and they leave "a" at the same point
    a = _req("a", tokens(22), tokens(2, 50))
    x = _req("x", _cat(tokens(16), tokens(8, 60)), [1])
    y = _req("y", _cat(tokens(16), tokens(8, 70)), [2])
    assert continuations([a, x, y], block_size=4)["a"].successor is None
    got = continuations([a, x, y], block_size=4, source_block=8)
    assert [got[r].successor for r in "axy"] == ["x", None, None]
