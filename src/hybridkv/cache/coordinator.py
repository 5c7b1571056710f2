"""The hybrid coordinator: every group of a layout behind one set of calls.

* **Cache hits** by a fixed point over groups: each group proposes the longest hit it can
  serve below the current bound; the bound drops to the minimum; groups whose hit is not
  prefix-closed re-check at the lower bound until every group agrees.  Prefix-closed groups
  (full attention, MLA) are scanned once.  The hit is a multiple of the layout's
  ``schedule_alignment`` and leaves at least the last prompt token to compute.
* **Allocation** is planned for every group, checked against the pool as a whole
  (:meth:`BlockPool.fits` is exact), then applied: all groups or none, and a refused call
  changes nothing at all.
* **Free / preempt** publish what is computed and drop every reference, tail first.

No validation of caller input happens here; :class:`hybridkv.cache.manager.KVCacheManager`
does it before calling in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from hybridkv.cache.admission import (
    JUNCTION,
    PROMPT_END,
    CheckpointAdmission,
)
from hybridkv.cache.coupling import CheckpointCoupling
from hybridkv.cache.dead_tails import DeadTails
from hybridkv.cache.events import EventLog
from hybridkv.cache.group_tuning import set_refresh_from, set_window_grids
from hybridkv.cache.hit_grid import HitGrid
from hybridkv.cache.kinds import KindManager, StepOutputs, StepPlan, manager_class
from hybridkv.cache.policies import (
    PUBLISH_MODES,
    WINDOW_RETENTION,
    check_policies,
    drops_dead_tails,
    lives_with_kv,
)
from hybridkv.cache.pool_base import DEFAULT_CHANCES
from hybridkv.cache.pools import make_block_pool
from hybridkv.cache.request import Request
from hybridkv.cache.request_state import HitResult, RequestState, check_requests
from hybridkv.cache.tier_bridge import LoadSpots, TierBridge
from hybridkv.cache.tier_sessions import TierSessions, hash_limit
from hybridkv.cache.tiers import TierSpec, TierStack, check_protect_share
from hybridkv.cache.types import AllocationResult, BlockId, TierLoad
from hybridkv.cache.window_spread import WindowSpread
from hybridkv.plan.layout import MemoryLayout, Strategy
from hybridkv.specs import CacheKind

__all__ = ["PUBLISH_MODES", "WINDOW_RETENTION", "HybridCoordinator"]


class HybridCoordinator:
    """Managers of every group of ``layout`` over one block pool."""

    def __init__(
        self,
        layout: MemoryLayout,
        *,
        events: EventLog,
        max_model_len: int | None = None,
        arena_eviction: str = "chunk_lru",
        eviction: str = "lru",
        second_chance: int = DEFAULT_CHANCES,
        window_chances: int | None = None,
        publish: str = "scheduled",
        window_retention: str = "tails",
        checkpoint_admission: str = "yield",
        tiers: Sequence[TierSpec] = (),
        tier_ops: bool = False,
        tier_admission: str = "yield",
        tier_write_through: str | None = None,
        checkpoint_when_full: str | None = None,
        protect_share: float = 1.0,
        dead_tails: str = "auto",
        checkpoint_life: str = "auto",
    ) -> None:
        protect_share = check_protect_share(protect_share)
        check_policies(
            publish=publish,
            window_retention=window_retention,
            checkpoint_admission=checkpoint_admission,
            tier_admission=tier_admission,
            checkpoint_when_full=checkpoint_when_full,
            dead_tails=dead_tails,
            checkpoint_life=checkpoint_life,
        )
        self.layout = layout
        self.events = events
        self.pool = make_block_pool(
            layout,
            events,
            arena_eviction=arena_eviction,
            eviction=eviction,
            second_chance=second_chance,
            window_chances=window_chances,
        )
        self.hash_block_size = layout.hash_block_size
        self.alignment = layout.schedule_alignment
        self.max_model_len = max_model_len
        self.managers: list[KindManager] = [
            manager_class(g.spec.kind)(
                g,
                self.pool,
                hash_block_size=self.hash_block_size,
                alignment=self.alignment,
                events=events,
            )
            for g in layout.groups
        ]
        self.num_groups = len(self.managers)
        for m in self.managers:
            m.dense_windows = window_retention == "all"
        self._closed = [m for m in self.managers if m.prefix_closed]
        self._open = [m for m in self.managers if not m.prefix_closed]
        set_window_grids(self._open, self._closed, self.alignment)
        #: A state checkpoint's parts (one per state group) leave the cache together, and
        #: under ``checkpoint_life="kv"`` with the prefix-closed block they end.
        with_kv = lives_with_kv(checkpoint_life, bool(tiers))
        self.coupling = CheckpointCoupling(self.managers, self.pool, events, with_kv)
        if with_kv:
            set_refresh_from(self.managers, self._closed)
        for g in self.coupling.groups[1:]:
            self.managers[g].credits = False
        self._attention = [m.group_id for m in self.managers if m.spec.kind is not CacheKind.STATE]
        #: Groups whose blocks compaction may move (:mod:`~hybridkv.cache.compaction`).
        self.movable = frozenset(self._attention)
        #: Windowed groups whose blocks share chunks (arena): the blocks a step's end pushes
        #: out of the window take whole free chunks (:mod:`~hybridkv.cache.window_spread`).
        self.spread = WindowSpread(self.managers, self.pool)
        #: :data:`~hybridkv.cache.admission.CHECKPOINT_WHEN_FULL`, resolved.
        self.when_full = checkpoint_when_full or self.when_full_default(layout.strategy)
        #: Where hits land (windowed groups also keep the window before a prompt's last point
        #: on it, see :mod:`hybridkv.cache.hit_grid`).
        self.hit_grid = HitGrid(self.alignment)
        for m in self.managers:
            m.hit_grid = self.hit_grid
        #: Lower tiers (host, disk) fed by device evictions and the rules between them and
        #: the groups, or None (set below).
        self.tiers: TierStack | None = None
        self.bridge: TierBridge | None = None
        #: Checkpoint admission by yield (None: every aligned checkpoint, or no state group).
        self._admission: CheckpointAdmission | None = None
        if checkpoint_admission == "yield" and len(self._attention) < self.num_groups:
            self.admission = CheckpointAdmission(layout.total_bytes)
            for m in self.managers:
                m.admission = self.admission
        #: Attention managers that publish a step's blocks at its allocation (``scheduled``).
        self._scheduled: list[tuple[int, KindManager]] = (
            [(i, m) for i, m in enumerate(self.managers) if m.publishes_scheduled]
            if publish == "scheduled"
            else []
        )
        self.requests: dict[str, RequestState] = {}
        self.nothing = AllocationResult(((),) * self.num_groups, (), (), ())
        if tiers:
            self.tiers = TierStack(
                tiers,
                [g.block_bytes for g in layout.groups],
                record_ops=tier_ops,
                events=events,
                block_sizes=[g.block_size for g in layout.groups],
                protect_share=protect_share,
            )
            self.bridge = TierBridge(
                self.tiers, self.managers, self.admission, tier_admission, tier_write_through
            )
            events.set_eviction_sink(self.bridge.evicted)
            for m in self.managers:
                m.hit_map = self.tiers.view(m.group_id, m.map)
        #: Drops freed requests' unread blocks past their hit (:mod:`~hybridkv.cache.dead_tails`;
        #: only where a group that is not prefix-closed bounds hits), or None.
        drop = drops_dead_tails(dead_tails, self.tiers is not None)
        self.dead_tails = DeadTails(self.managers, self.pool) if drop and self._open else None
        #: Prefixes clients protect in the lower tiers (:mod:`hybridkv.cache.tier_sessions`).
        per_hash = sum(m.block_bytes // m.stride for m in self._closed)
        self.sessions = TierSessions(
            self.tiers, hash_limit(self.tiers, layout.total_bytes, per_hash)
        )

    # -- hits -------------------------------------------------------------------------------
    def find_hit(
        self, request: Request, standalone: bool = False, end: int | None = None
    ) -> HitResult:
        """The longest hit every group can serve (see module doc).  Reads only.  ``end``:
        look up to that many tokens instead of leaving the last one to compute (the hit a
        longer request with this prefix would find).

        Groups that are not prefix-closed are looked up below the prefix-closed groups' hit
        (their ``alone`` entry is then their hit below it); with ``standalone`` below the
        request's own bound, so ``alone`` is every group's standalone hit (a diagnostic that
        costs a scan of each windowed group's whole prompt per query)."""
        hashes = request.block_hashes
        bound = request.num_tokens - 1 if end is None else end
        if self.max_model_len is not None and bound > self.max_model_len:
            bound = self.max_model_len
        bound -= bound % self.alignment
        alone = [0] * self.num_groups
        if bound <= 0:
            return HitResult(0, alone, 0)
        cur = bound
        for m in self._closed:
            h = m.longest_hit(hashes, bound)
            alone[m.group_id] = h
            if h < cur:
                cur = h
        top = bound if standalone else cur
        for m in self._open:
            h = m.longest_hit(hashes, top)
            alone[m.group_id] = h
            if h < cur:
                cur = h
        hits = list(alone)
        again = True
        while again and cur:
            again = False
            for m in self._open:
                g = m.group_id
                if hits[g] > cur:
                    h = m.longest_hit(hashes, cur)
                    hits[g] = h
                    if h < cur:
                        cur = h
                        again = True
        if self._closed:  # prefix-closed groups define where the cached prefix ends
            junction = min(alone[m.group_id] for m in self._closed)
        else:
            junction = max((alone[g] for g in self._attention), default=cur)
        return HitResult(cur, alone, junction)

    def hit_blocks(self, request: Request, length: int) -> tuple[tuple[BlockId, ...], ...]:
        """Every group's blocks for a hit of ``length`` tokens (which all groups serve)."""
        if not length:
            return ((),) * self.num_groups
        hashes = request.block_hashes
        return tuple(
            cast(tuple[BlockId, ...], tuple(m.hit_blocks(hashes, length))) for m in self.managers
        )

    @property
    def admission(self) -> CheckpointAdmission | None:
        """The checkpoint admission (None: every aligned checkpoint, or no state group);
        setting it also sets the tier rules' (the managers' are set by the caller)."""
        return self._admission

    @admission.setter
    def admission(self, value: CheckpointAdmission | None) -> None:
        self._admission = value
        if self.bridge is not None:
            self.bridge.admission = value

    def retain(self, request: Request) -> int:
        """Refresh the lower-tier entries ``request``'s hit would read now (see
        :meth:`KVCacheManager.retain_hit`); returns how many."""
        if self.bridge is None:
            return 0
        length = self.find_hit(request).length
        if not length:
            return 0
        return self.bridge.retain(request, length, self.hit_blocks(request, length))

    def tier_blocks(
        self, request: Request, hit: Sequence[Sequence[int]], length: int
    ) -> list[tuple[int, int, str]]:
        """See :meth:`TierBridge.tier_blocks` (empty without tiers)."""
        return [] if self.bridge is None else self.bridge.tier_blocks(request, hit, length)

    def persist(self, tier: str) -> None:
        """See :meth:`TierBridge.persist` (the coordinator has tiers)."""
        assert self.bridge is not None
        self.bridge.persist(tier)

    # -- allocation ---------------------------------------------------------------------------
    def allocate(
        self,
        rs: RequestState | None,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        hit: Sequence[Sequence[int]] | None,
        num_lookahead_tokens: int,
        junction: int = 0,
        num_reserved_tokens: int = 0,
    ) -> AllocationResult | None:
        """Allocate slots for one step of ``request`` (validated by the caller).

        ``rs`` is None on the request's first allocation (``hit`` and ``junction``, from
        :meth:`find_hit`, only then).  ``num_reserved_tokens``: prefix-closed groups also
        cover that many tokens past the step.  Returns None, changing nothing, when the pool
        cannot serve every group.
        """
        computed = request.num_computed_tokens
        num_computed = computed + num_new_computed_tokens
        step_end = num_computed + num_new_tokens
        total = step_end + num_lookahead_tokens
        if self.max_model_len is not None and total > self.max_model_len:
            total = max(self.max_model_len, step_end)
        reserved = max(total, step_end + num_reserved_tokens)
        if self.max_model_len is not None and reserved > self.max_model_len:
            reserved = max(self.max_model_len, total)
        managers = self.managers
        if rs is None:
            marks = tuple(x for x in (num_new_computed_tokens, junction) if x)
            plans = [
                m.plan(
                    None,
                    request,
                    computed,
                    num_computed,
                    step_end,
                    reserved if m.prefix_closed else total,
                    hit[i] if hit else None,
                    marks,
                )
                for i, m in enumerate(managers)
            ]
        else:
            marks = rs.marks
            plans = [
                m.plan(
                    st,
                    request,
                    computed,
                    num_computed,
                    step_end,
                    reserved if m.prefix_closed else total,
                    None,
                    marks,
                )
                for m, st in zip(managers, rs.groups, strict=True)
            ]
            if not any(plans):  # the common decode step: nothing to publish, free or take
                if total > rs.num_slots:
                    rs.num_slots = total
                if reserved > rs.num_reserved:
                    rs.num_reserved = reserved
                rs.min_computed = num_computed
                for i, m in self._scheduled:
                    st = rs.groups[i]
                    if step_end // m.block_size > st.num_cached:
                        m.publish_scheduled(st, request, step_end)
                self._set_quiet(rs, num_computed)
                return self.nothing
        markers: list[int] | None = None
        if hit and self.tiers is not None:
            markers = [sum(1 for b in blocks if b < 0) for blocks in hit]
            if any(markers):  # tier blocks: a fresh device block each, not a touch
                plans = [
                    p._replace(need=p.need + k, touch=[b for b in p.touch or () if b >= 0] or None)
                    if k and p is not None
                    else p
                    for p, k in zip(plans, markers, strict=True)
                ]
            else:
                markers = None
        if not self._fits(plans):
            # The checkpoint is an optimisation: under ``skip`` / ``skip_minor`` the step may run
            # without it (a refusal preempts a running request; alone, nothing could be).
            alone = not self.requests or (rs is not None and len(self.requests) == 1)
            mode = "skip" if alone else self.when_full
            if mode == "refuse" or not any(p is not None and p.checkpoint for p in plans):
                return None
            if mode == "skip_minor" and (
                rs is None
                or any(
                    p is not None and p.checkpoint and p.reason in (JUNCTION, PROMPT_END)
                    for p in plans
                )
            ):
                return None
            plans = [
                p._replace(need=p.need - 1, checkpoint=0, reason=0)
                if p is not None and p.checkpoint
                else p
                for p in plans
            ]
            if not self._fits(plans):
                return None
        if rs is None:
            rs = RequestState(request, [m.new_state() for m in managers], marks)
            for m, st in zip(managers, rs.groups, strict=True):
                m.start(st, request, marks)
            self.requests[request.request_id] = rs
            self.hit_grid.observe(junction)
            if hit and num_new_computed_tokens and self.admission is not None:
                self.admission.hit(num_new_computed_tokens)
                for i, (m, blocks) in enumerate(zip(managers, hit, strict=True)):
                    if not m.credits:
                        continue
                    if blocks and blocks[0] < 0 and self.bridge is not None:
                        self.bridge.credit_checkpoint(i, request, num_new_computed_tokens, blocks)
                        continue
                    m.credit_hit(blocks, num_new_computed_tokens)
        groups = rs.groups
        for i, p in enumerate(plans):
            if p is not None:
                managers[i].apply_release(groups[i], p, hit[i] if hit else None, request)
        for i, p in enumerate(plans):
            if p is not None and p.touch:
                managers[i].apply_touch(groups[i], p)
        out = StepOutputs()
        loads: list[TierLoad] = []
        spots: list[LoadSpots] | None = None
        bridge = self.bridge
        if markers is not None and hit is not None and bridge is not None:
            spots = bridge.load_spots(request, hit, markers, num_new_computed_tokens)
        new_ids: list[tuple[BlockId, ...]] = []
        pool = self.pool
        spans = self.spread.spans(plans, markers, total, step_end) if self.spread.groups else {}
        try:
            for i, p in enumerate(plans):
                if p is None or not p.need:
                    new_ids.append(())
                    continue
                # One allocation per group, in group order, as fits() counted it; a hit's
                # tier blocks take the first ones.
                span = spans.get(i)
                if span is not None:
                    blocks = self.spread.allocate(i, p.need, span)
                else:
                    blocks = pool.allocate(i, p.need)
                if spots is not None and spots[i][0]:
                    assert bridge is not None
                    k = len(spots[i][0])
                    bridge.install_loads(request, groups[i], i, spots[i], blocks[:k], loads)
                    blocks = blocks[k:]
                added = managers[i].apply_new(groups[i], p, blocks, out) if blocks else ()
                new_ids.append(cast(tuple[BlockId, ...], tuple(added)))
        finally:
            if spots is not None and bridge is not None:
                bridge.tiers.unpin()  # every load is recorded (or the allocation broke)
        for i, m in self._scheduled:
            if step_end // m.block_size > groups[i].num_cached:
                m.publish_scheduled(groups[i], request, step_end)
        if self.events.orphaned:
            self.coupling.sweep()
        if bridge is not None:
            self.sessions.enforce()  # the evictions may have brought protected entries down
        if total > rs.num_slots:
            rs.num_slots = total
        if reserved > rs.num_reserved:
            rs.num_reserved = reserved
        rs.min_computed = num_computed
        self._set_quiet(rs, num_computed)
        return AllocationResult(
            tuple(new_ids),
            tuple(out.copies_before),
            tuple(out.zero_before),
            tuple(out.copies_after),
            tuple(loads),
        )

    def _set_quiet(self, rs: RequestState, num_computed: int) -> None:
        end = computed = self.max_model_len if self.max_model_len is not None else 1 << 62
        for m, st in zip(self.managers, rs.groups, strict=True):
            e, c = m.quiet_end(st, num_computed)
            if e < end:
                end = e
            if c < computed:
                computed = c
        for i, m in self._scheduled:  # publish_scheduled acts once a step fills a block
            e = (rs.groups[i].num_cached + 1) * m.block_size - 1
            if e < end:
                end = e
        rs.quiet = end
        rs.quiet_computed = computed

    @staticmethod
    def when_full_default(strategy: Strategy) -> str:
        """The :data:`~hybridkv.cache.admission.CHECKPOINT_WHEN_FULL` policy by layout.

        ``pools``: ``skip``: the state group's own pool can be full of running slots, and
        preempting a request to free one for a checkpoint trades its recompute for an
        optimisation.  ``arena``: ``skip_minor``: a checkpoint takes a whole chunk, and the
        newest request a refusal preempts rarely frees one (its attention blocks lie in
        chunks other requests still hold), so refusals cascade into preemption storms (the
        Mooncake trace, Qwen3-Next-80B-A3B at 8 GiB: 2,417 preemptions with ``refuse``, 9
        with ``skip_minor``, docs/architecture.md).  ``uniform``: ``refuse``: one page of
        every group is the same size there, so preempting the newest request frees what the
        checkpoint needs, and skipping measured no better."""
        if strategy is Strategy.POOLS:
            return "skip"
        return "skip_minor" if strategy is Strategy.ARENA else "refuse"

    def _fits(self, plans: list[StepPlan | None]) -> bool:
        for p in plans:
            if p is not None and (p.need or p.release or p.touch):
                break
        else:
            return True
        pool = self.pool
        if pool.reads_cached_hint:
            cached = [{b for _, b, _ in p.cache} if p and p.cache else None for p in plans]
        else:
            cached = [None] * len(plans)
        return pool.fits(
            cached,
            [p.release if p else None for p in plans],
            [p.touch if p else None for p in plans],
            [p.need if p else 0 for p in plans],
        )

    # -- free ---------------------------------------------------------------------------------
    def release(self, request_id: str) -> RequestState | None:
        """Publish computed blocks and drop every reference of ``request_id`` (None if none);
        then its dead tails (:mod:`~hybridkv.cache.dead_tails`) when they are dropped."""
        rs = self.requests.pop(request_id, None)
        if rs is None:
            return None
        end = rs.request.num_computed_tokens
        marks = (*rs.marks, end - end % self.alignment)
        dead = self.dead_tails
        tables = None if dead is None else dead.tables(rs)  # before the references go
        for m, st in zip(self.managers, rs.groups, strict=True):
            m.release_all(st, rs.request)
            m.protect(rs.request.block_hashes, marks)
        dropped = False
        if dead is not None and tables is not None:
            hit = self.find_hit(rs.request, end=end).length  # where a longer request would hit
            dropped = dead.drop(tables, hit) > 0
        if self.events.orphaned:  # dropped blocks may end checkpoints (checkpoint_life)
            dropped = self.coupling.sweep() > 0 or dropped
        if dropped and self.bridge is not None:
            # after both: the drops and the checkpoint parts the sweep dropped went down a
            # tier, protected ones too (found by review: enforcing before the sweep left a
            # tier over its protected share)
            self.sessions.enforce()
        return rs

    def reset_prefix_cache(self) -> bool:
        """Drop every cached hash; refused (False, no change) while any block is referenced."""
        if self.requests:
            return False
        if not self.pool.reset_cache():
            return False
        if self.tiers is not None:
            self.tiers.clear()
        if self.events.enabled:
            self.events.cleared()
        return True

    # -- introspection ------------------------------------------------------------------------
    def block_ids(self, rs: RequestState) -> tuple[list[int], ...]:
        return tuple(list(m.table(st)) for m, st in zip(self.managers, rs.groups, strict=True))

    def check_invariants(self) -> None:
        """Pool and tier invariants, each request's per-group invariants, and ref counts ==
        holders."""
        self.pool.check_invariants()
        self.coupling.check()
        if self.tiers is not None:
            self.tiers.check_invariants()
        self.sessions.check_invariants()
        check_requests(self.requests.values(), self.managers, self.pool)

    def snapshot(self) -> Any:
        """A deep, comparable copy of every structure (pool, tables, cursors, events)."""
        reqs = {
            rid: (
                rs.num_slots,
                rs.num_reserved,
                rs.min_computed,
                [
                    (
                        list(st.table),
                        st.num_cached,
                        st.released,
                        st.pending,
                        st.pending_index,
                        st.source,
                        st.keep,
                        st.withheld,
                    )
                    for st in rs.groups
                ],
            )
            for rid, rs in self.requests.items()
        }
        tiers = None if self.tiers is None else self.tiers.snapshot()
        sessions = sorted((k, tuple(v)) for k, v in self.sessions.sessions.items())
        return (self.pool.snapshot(), reqs, len(self.events), tiers, sessions)
