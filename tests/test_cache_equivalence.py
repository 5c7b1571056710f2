"""Twin managers in lock-step: the fast paths must not change a single observable.

Manager A is the default build: the decode fast path on (``KVCacheManager.fast_path``) and,
for an arena whose chunk is every group's block, the :class:`FlatArenaPool`.  Manager B
plans every allocation (``fast_path = False``) and runs such arenas on the general
:class:`ArenaPool` (a one-group arena with several blocks per chunk stays flat in both: its
per-block LRU is meant to differ from the arena's chunk-level one).  Both see the same
operations (arrivals, hits, chunked prefills, decode with lookahead, finishes, preemptions,
resets); after each one their answers, block tables, per-request cursors, reference counts,
prefix caches (hash -> block) and KV events must be equal, and both pass
``check_invariants()``.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import strategies as hst
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import hybridkv.cache.coordinator as coordinator_module
from hybridkv.cache import (
    PUBLISH_MODES,
    WINDOW_RETENTION,
    AllBlocksCleared,
    BlockStored,
    KVCacheManager,
    Request,
    compiled,
)
from hybridkv.cache.pool_arena import ArenaPool
from hybridkv.cache.pool_base import group_chances
from hybridkv.cache.pool_shared import FlatArenaPool
from hybridkv.plan.layout import MemoryLayout
from test_cache_factories import groups, layout_for, spec_items, tokens

BASE = tokens(40, start=10)


def _general_pool_manager(layout: MemoryLayout, **kw: Any) -> KVCacheManager:
    """A manager whose equal-page arena layouts run on :class:`ArenaPool`."""
    original = coordinator_module.make_block_pool

    def general(
        layout: MemoryLayout,
        events: Any,
        *,
        arena_eviction: str = "chunk_lru",
        eviction: str = "lru",
        second_chance: int = 1,
        window_chances: int | None = None,
    ) -> Any:
        arena = layout.arena
        if arena is not None and all(g.block_bytes == arena.chunk_bytes for g in layout.groups):
            caps = group_chances(layout, second_chance, window_chances)
            return ArenaPool(layout, events, eviction=arena_eviction, chances=caps)
        return original(
            layout,
            events,
            arena_eviction=arena_eviction,
            eviction=eviction,
            second_chance=second_chance,
            window_chances=window_chances,
        )

    coordinator_module.make_block_pool = general  # type: ignore[assignment]
    try:
        mgr = KVCacheManager(layout, **kw)
    finally:
        coordinator_module.make_block_pool = original
    mgr.fast_path = False
    return mgr


def _view(mgr: KVCacheManager) -> Any:
    """Everything a caller or a KV-event consumer can observe, pool internals aside."""
    pool = mgr.pool
    coord = mgr._coord
    requests = {
        rid: (
            rs.num_slots,
            rs.min_computed,
            [
                (list(st.table), st.num_cached, st.released, st.pending, st.source)
                for st in rs.groups
            ],
        )
        for rid, rs in coord.requests.items()
    }
    refs = [  # uniform-style pools share one refs list between groups: read it per group
        [(b, r) for b, r in enumerate(pool.refs[g]) if r and pool.is_allocated(g, b)]
        for g in range(mgr.num_groups)
    ]
    maps = [dict(m) for m in pool.maps]
    free = [pool.num_free(g) for g in range(mgr.num_groups)]
    return requests, refs, maps, free, mgr.usage


def _per_group(events: list[Any]) -> Any:
    """Events as each group's sequence of (stored or removed, hash) plus the clears: how a
    pool batches removals into events, and interleaves groups, is not part of the contract."""
    out: dict[Any, list[Any]] = {}
    for e in events:
        if isinstance(e, AllBlocksCleared):
            out.setdefault("cleared", []).append(len(out))
            continue
        what = "stored" if isinstance(e, BlockStored) else "removed"
        out.setdefault(e.group_id, []).extend((what, h) for h in e.block_hashes)
    return out


class TwinMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.a: KVCacheManager | None = None
        self.b: KVCacheManager | None = None
        self.waiting: list[tuple[Request, Request]] = []
        self.running: list[tuple[Request, Request]] = []
        self.count = 0

    @initialize(
        equal_pages=hst.booleans(),
        items=hst.lists(spec_items(), min_size=1, max_size=3),
        strategy=hst.sampled_from(["arena_one", "arena_one", "arena", "uniform", "pools"]),
        capacity=hst.integers(3, 10),
        publish=hst.sampled_from(PUBLISH_MODES),
        retention=hst.sampled_from(WINDOW_RETENTION),
        second_chance=hst.integers(0, 3),
        window_chances=hst.sampled_from([None, 0, 1, 3]),
    )
    def setup(
        self,
        equal_pages: bool,
        items: list,
        strategy: str,
        capacity: int,
        publish: str,
        retention: str,
        second_chance: int,
        window_chances: int | None,
    ) -> None:
        if equal_pages:  # block size 4: every tiny spec has 128-byte blocks
            items = [(spec, 4) for spec, _ in items]
        layout = layout_for(strategy, groups(*items), capacity)
        kw: dict[str, Any] = {
            "hasher": "builtin",
            "enable_kv_events": True,
            "publish": publish,
            "window_retention": retention,
            "second_chance": second_chance,
            "window_chances": window_chances,
        }
        self.a = KVCacheManager(layout, **kw)
        self.b = _general_pool_manager(layout, **kw)
        if strategy == "arena_one" and equal_pages:
            assert isinstance(self.a.pool, FlatArenaPool)
            assert isinstance(self.b.pool, ArenaPool)

    def _both(self) -> tuple[KVCacheManager, KVCacheManager]:
        assert self.a is not None and self.b is not None
        return self.a, self.b

    @rule(prefix=hst.integers(0, 36), tail=hst.lists(hst.integers(0, 2), min_size=1, max_size=8))
    def arrive(self, prefix: int, tail: list[int]) -> None:
        if self.a is None:
            return
        a, b = self._both()
        self.count += 1
        ids = BASE[:prefix] + tail
        rid = f"r{self.count}"
        self.waiting.append((a.make_request(rid, ids), b.make_request(rid, ids)))

    @precondition(lambda self: self.waiting)
    @rule(which=hst.integers(0, 7), budget=hst.integers(1, 24))
    def admit(self, which: int, budget: int) -> None:
        a, b = self._both()
        ra, rb = pair = self.waiting[which % len(self.waiting)]
        ha, hb = a.get_computed_blocks(ra), b.get_computed_blocks(rb)
        assert ha == hb
        n = min(budget, ra.num_tokens - ha.num_computed_tokens)
        kw = {"num_new_computed_tokens": ha.num_computed_tokens}
        res_a = a.allocate_slots(ra, n, new_computed_blocks=ha, **kw)
        res_b = b.allocate_slots(rb, n, new_computed_blocks=hb, **kw)
        assert res_a == res_b
        if res_a is None:
            return
        self.waiting.remove(pair)
        self.running.append(pair)
        for r in pair:
            r.num_computed_tokens = ha.num_computed_tokens + n

    @precondition(lambda self: self.running)
    @rule(which=hst.integers(0, 7), budget=hst.integers(1, 6), lookahead=hst.integers(0, 2))
    def advance(self, which: int, budget: int, lookahead: int) -> None:
        a, b = self._both()
        ra, rb = self.running[which % len(self.running)]
        if ra.num_computed_tokens == ra.num_tokens:
            for r in (ra, rb):
                r.append_token_ids([r.num_tokens % 3])
        n = min(budget, ra.num_tokens - ra.num_computed_tokens)
        res_a = a.allocate_slots(ra, n, num_lookahead_tokens=lookahead)
        res_b = b.allocate_slots(rb, n, num_lookahead_tokens=lookahead)
        assert res_a == res_b
        if res_a is not None:
            for r in (ra, rb):
                r.num_computed_tokens += n

    @precondition(lambda self: self.running)
    @rule(which=hst.integers(0, 7), steps=hst.integers(1, 12))
    def decode(self, which: int, steps: int) -> None:
        """One token per step (the fast path's case), compared after every step."""
        a, b = self._both()
        ra, rb = self.running[which % len(self.running)]
        for _ in range(steps):
            if ra.num_computed_tokens == ra.num_tokens:
                for r in (ra, rb):
                    r.append_token_ids([r.num_tokens % 3])
            n = ra.num_tokens - ra.num_computed_tokens
            res_a, res_b = a.allocate_slots(ra, n), b.allocate_slots(rb, n)
            assert res_a == res_b
            if res_a is None:
                return
            for r in (ra, rb):
                r.num_computed_tokens += n
            self.identical()  # a skipped release or publication shows only until caught up

    @precondition(lambda self: self.running)
    @rule(which=hst.integers(0, 7), finish=hst.booleans())
    def leave(self, which: int, finish: bool) -> None:
        a, b = self._both()
        ra, rb = pair = self.running.pop(which % len(self.running))
        if finish:
            a.free(ra.request_id)
            b.free(rb.request_id)
        else:
            a.preempt(ra.request_id)
            b.preempt(rb.request_id)
            self.waiting.append(pair)

    @rule()
    def reset(self) -> None:
        if self.a is None:
            return
        a, b = self._both()
        assert a.reset_prefix_cache() == b.reset_prefix_cache()

    @invariant()
    def identical(self) -> None:
        if self.a is None:
            return
        a, b = self._both()
        a.check_invariants()
        b.check_invariants()
        assert _view(a) == _view(b)
        assert _per_group(a.take_events()) == _per_group(b.take_events())
        for ra, rb in self.running:
            assert a.get_block_ids(ra.request_id) == b.get_block_ids(rb.request_id)


TwinMachine.TestCase.settings = TwinMachine.TestCase.settings.__class__(
    TwinMachine.TestCase.settings, stateful_step_count=30, max_examples=200
)
TestTwins = pytest.mark.skipif(
    compiled(), reason="swaps a module function the compiled coordinator binds early"
)(TwinMachine.TestCase)
