"""The per-kind manager contract: one manager per group, one rule per cache kind.

A manager owns nothing but rules; the per-request data lives in a :class:`GroupState` the
coordinator keeps, and every block goes through the group's :class:`BlockPool`.  Each manager
answers four questions:

* how many blocks ``n`` more token slots need (:meth:`KindManager.plan`);
* the longest cache hit below a bound, by its own rule (:meth:`KindManager.longest_hit`);
* what to release as tokens age out (the plan's ``release``);
* what to publish to the prefix cache (the plan's ``cache``).

An allocation is planned for every group first (no mutation), checked against the pool as a
whole, then applied in three phases over all groups: (1) cache and release, (2) touch hit
blocks, (3) allocate new blocks.  A block is published once its tokens are computed, i.e.
below ``request.num_computed_tokens`` as the scheduler reports it at the next call (or at
``free``); attention kinds may publish earlier, at the allocation of the step that fills them
(:meth:`KindManager.publish_scheduled`, the coordinator's ``scheduled`` mode), under the
runner's contract that a step writes its new tokens before anything reads them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

from hybridkv.cache.admission import CheckpointAdmission
from hybridkv.cache.events import EventLog
from hybridkv.cache.hit_grid import HitGrid
from hybridkv.cache.pool_base import BlockPool
from hybridkv.cache.request import Request
from hybridkv.cache.types import StateCopy, StateSlot
from hybridkv.errors import InvariantError
from hybridkv.plan.layout import GroupPlan
from hybridkv.specs import CacheKind

__all__ = ["GroupState", "KindManager", "StepOutputs", "StepPlan"]


class GroupState:
    """One request's data in one group: its block table and bookkeeping cursors.

    ``table[j]`` is the block of tokens ``[j*block_size, (j+1)*block_size)`` (attention kinds;
    0 where the kind keeps nothing) or ``[running slot]`` (state kinds).  ``num_cached``:
    table entries already offered to the prefix cache.  ``released``: table entries below it
    that the kind may have nulled.  ``pending`` / ``pending_index`` / ``source``: state kinds'
    checkpoint awaiting publication (index of the block it ends) and hit checkpoint awaiting
    its copy (0 = none).  ``keep``: windowed kinds under tail retention, the ``[lo, hi)`` table
    ranges worth publishing (None: every block).  ``withheld``: table entries an import
    could not write in full, never published (the other instance had released some of their
    tokens; :meth:`KindManager.drop_unread`).  ``saved``: state kinds, the checkpoints
    this request published, as ``(slot, hash)`` (refreshed when it frees its blocks under
    ``checkpoint_life="kv"``; None: none, or not tracked).
    """

    __slots__ = (
        "keep",
        "num_cached",
        "pending",
        "pending_index",
        "released",
        "saved",
        "source",
        "table",
        "withheld",
    )

    def __init__(self, released: int = 0) -> None:
        self.keep: tuple[tuple[int, int], ...] | None = None
        self.table: list[int] = []
        self.num_cached = 0
        self.released = released
        self.pending = 0
        self.pending_index = 0
        self.source = 0
        self.saved: list[tuple[int, int]] | None = None
        self.withheld: tuple[int, ...] = ()


class StepPlan(NamedTuple):
    """What one group will do in one allocation (computed without mutating anything).

    ``cache``: ``(table index, block, hash)`` to publish; ``cache_upto``: the new
    ``num_cached``; ``release``: blocks to drop a reference from, in order;
    ``release_upto``: the new ``released``; ``touch``: hit blocks to reference; ``need``:
    fresh blocks to allocate; ``checkpoint``: state kinds only, the number of blocks the
    step ends at when it saves a checkpoint there (0: none), and ``reason`` why (a
    :data:`hybridkv.cache.admission.CHECKPOINT_REASONS` index).
    """

    cache: list[tuple[int, int, int]] | None
    cache_upto: int
    release: list[int] | None
    release_upto: int
    touch: list[int] | None
    need: int
    checkpoint: int
    reason: int = 0


class StepOutputs:
    """Accumulates the per-call outputs the coordinator turns into an AllocationResult."""

    __slots__ = ("copies_after", "copies_before", "zero_before")

    def __init__(self) -> None:
        self.copies_before: list[StateCopy] = []
        self.zero_before: list[StateSlot] = []
        self.copies_after: list[StateCopy] = []


class KindManager(ABC):
    """Rules of one cache kind, bound to one group and its pool."""

    kinds: ClassVar[tuple[CacheKind, ...]]
    #: True when a hit of n tokens implies hits of every shorter aligned length.
    prefix_closed: ClassVar[bool] = False
    #: True when the kind can publish a step's blocks at its allocation (attention kinds).
    publishes_scheduled: ClassVar[bool] = False
    #: Windowed kinds: publish every computed block (True) or only likely-hit tails.
    dense_windows: bool = True
    #: Windowed kinds under tail retention: also keep the tail before every multiple of this
    #: many tokens of the prompt (0: none).
    window_grid: int = 0
    #: State checkpoint admission shared by the coordinator's groups (None: admit all).
    admission: CheckpointAdmission | None = None
    #: Whether this group's checkpoints count in the admission's statistics (hits, number of
    #: checkpoints; their bytes always do): the first state group only, since a checkpoint
    #: stored as one part per state group is one checkpoint.
    credits: bool = True
    #: Where hits land, learned by the coordinator (None: only the alignment is known).
    hit_grid: HitGrid | None = None

    def __init__(
        self,
        group: GroupPlan,
        pool: BlockPool,
        *,
        hash_block_size: int,
        alignment: int,
        events: EventLog,
    ) -> None:
        g = group.group_id
        self.group = group
        self.group_id = g
        self.spec = group.spec
        self.block_size = group.block_size
        #: Hash blocks per block: block j is named by ``hashes[(j + 1) * stride - 1]``.
        self.stride = group.block_size // hash_block_size
        #: Blocks per schedule-alignment step (hits are multiples of it).
        self.align_blocks = alignment // group.block_size
        self.alignment = alignment
        self.hash_block_size = hash_block_size
        self.pool = pool
        self.events = events
        self.refs = pool.refs[g]
        self.block_hashes = pool.hashes[g]
        self.map = pool.maps[g]
        #: What hit lookups read: the device map, or a :class:`~hybridkv.cache.tiers.TieredMap`
        #: over it and the lower tiers (tier-only hashes map to the load marker ``-1``).
        self.hit_map: Any = self.map
        self.block_bytes = group.block_bytes
        #: With a write-through tier: every publication ``(group, items)`` is appended here
        #: (:meth:`~hybridkv.cache.tier_bridge.TierBridge.flush_through` stores the blocks
        #: once their step ran).
        self.through: list[tuple[int, list[tuple[int, int, int]]]] | None = None
        self._configure()

    def present(self, hashes: Sequence[int]) -> bytes:
        """``present(h)[i] == 1`` iff a hit can read ``hashes[i]`` (on the device, or in a
        lower tier when there are tiers), looked up at C speed."""
        m = self.hit_map
        if m is self.map:
            return bytes(map(m.__contains__, hashes))
        flags: bytes = m.flags(hashes)
        return flags

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The block each of ``hashes`` (all cached) is read from: a device block, or ``-1``
        for one only a lower tier holds."""
        m = self.hit_map
        if m is self.map:
            return list(map(m.__getitem__, hashes))
        blocks: list[int] = m.blocks(hashes)
        return blocks

    def _configure(self) -> None:  # noqa: B027 - an optional hook, not an abstract method
        """Hook for subclasses: read kind-specific fields of ``self.spec``."""

    # -- prefix-cache hits --------------------------------------------------------------------
    @abstractmethod
    def longest_hit(self, hashes: Sequence[int], bound: int) -> int:
        """Largest ``L <= bound``, a multiple of the alignment, this group can serve (tokens).

        ``hashes`` are the request's block hashes; ``bound`` a multiple of the alignment.
        Reads the prefix cache only.
        """

    @abstractmethod
    def hit_blocks(self, hashes: Sequence[int], length: int) -> list[int]:
        """What this group holds for a hit of ``length`` tokens (which it must serve)."""

    def hit_error(self, hashes: Sequence[int], length: int, blocks: Sequence[int]) -> str | None:
        """Why ``blocks`` are not a valid hit of ``length`` tokens now (None when they are)."""
        try:
            expected = self.hit_blocks(hashes, length)
        except (KeyError, IndexError):
            return f"group {self.group_id} no longer caches a hit of {length} tokens"
        if list(blocks) != expected:
            return (
                f"group {self.group_id}: blocks {list(blocks)[:8]}... are not the cached hit "
                f"of {length} tokens"
            )
        return None

    # -- allocation ---------------------------------------------------------------------------
    def new_state(self) -> GroupState:
        return GroupState()

    def start(self, st: GroupState, request: Request, marks: Sequence[int]) -> None:  # noqa: B027
        """Hook at a request's first allocation (``marks``: its hit and junction, tokens)."""

    @abstractmethod
    def plan(
        self,
        st: GroupState | None,
        request: Request,
        computed: int,
        num_computed: int,
        step_end: int,
        total: int,
        hit: Sequence[int] | None,
        marks: Sequence[int] = (),
    ) -> StepPlan | None:
        """Plan one allocation for this group (None: nothing to do).  Mutates nothing.

        ``st`` is None for a request's first allocation; ``computed``: tokens computed by
        earlier steps (``request.num_computed_tokens``); ``num_computed``: plus the hit;
        ``step_end``: computed length after this step; ``total``: token slots needed,
        lookahead included; ``hit``: this group's hit blocks (first allocation only);
        ``marks``: the request's hit and junction (tokens).
        """

    def apply_release(
        self, st: GroupState, plan: StepPlan, hit: Sequence[int] | None, request: Request
    ) -> None:
        """Phase 1: install a hit table, publish ``plan.cache``, release ``plan.release``."""
        if hit:
            st.table = list(hit)
            st.num_cached = len(hit)
        if plan.cache:
            self._publish(plan.cache, request)
        if plan.cache_upto > st.num_cached:
            st.num_cached = plan.cache_upto
        if plan.release_upto > st.released:
            table = st.table
            for j in range(st.released, min(plan.release_upto, len(table))):
                table[j] = 0
            st.released = plan.release_upto
        if plan.release:
            self.pool.release(self.group_id, plan.release)

    def credit_hit(self, hit: Sequence[int], tokens: int) -> None:  # noqa: B027
        """Hook when a request is admitted with a hit of ``tokens`` on the blocks ``hit``
        (state kinds credit the checkpoint's admission reason)."""

    def tier_spots(
        self, hashes: Sequence[int], length: int, hit: Sequence[int]
    ) -> list[tuple[int, int]]:
        """``(table index, hash)`` of every lower-tier block (marker ``-1``) of a hit of
        ``length`` tokens whose blocks here are ``hit``."""
        k = self.stride
        return [(j, hashes[(j + 1) * k - 1]) for j, b in enumerate(hit) if b < 0]

    def install_loaded(
        self, st: GroupState, spots: Sequence[tuple[int, int]], blocks: Sequence[int]
    ) -> list[tuple[int, int, int]]:
        """Put the device blocks ``blocks`` allocated for the tier blocks at ``spots`` where
        the hit's markers are; returns the ``(index, block, hash)`` items to publish."""
        table = st.table
        items = []
        for (j, h), b in zip(spots, blocks, strict=True):
            table[j] = b
            items.append((j, b, h))
        return items

    def apply_touch(self, st: GroupState, plan: StepPlan) -> None:
        """Phase 2: reference the hit blocks."""
        if plan.touch:
            self.pool.touch(self.group_id, plan.touch)

    def apply_new(
        self, st: GroupState, plan: StepPlan, new: list[int], out: StepOutputs
    ) -> Sequence[int]:
        """Phase 3: append freshly allocated blocks; returns the table's new entries."""
        if new:
            st.table.extend(new)
        return new

    def quiet_end(self, st: GroupState, num_computed: int) -> tuple[int, int]:
        """Bounds ``(step_end, computed)`` up to which a later allocation without hit or
        lookahead, from ``num_computed <= computed <= step_end``, plans nothing here: no new
        block, release, publication once computed, or checkpoint (``(0, 0)``: no such
        guarantee; :meth:`publish_scheduled` is bounded by the coordinator).  Lets the
        manager skip planning the common decode step; it must be conservative."""
        return 0, 0

    def publish_scheduled(self, st: GroupState, request: Request, step_end: int) -> None:
        """Publish what the step ending at ``step_end`` fills, before it runs (the
        ``scheduled`` mode; only kinds with :attr:`publishes_scheduled`)."""
        raise InvariantError(f"group {self.group_id}: {self.spec.kind} publishes once computed")

    def publish_loaded(self, items: list[tuple[int, int, int]], request: Request) -> None:
        """Publish device blocks read back from a lower tier (no admission accounting: the
        data was published before)."""
        self.pool.cache_many(self.group_id, items)
        if self.events.enabled:
            self._emit_stored(items, request)

    def _publish(self, items: list[tuple[int, int, int]], request: Request) -> None:
        self.pool.cache_many(self.group_id, items)
        if self.through is not None:
            self.through.append((self.group_id, items))
        if self.admission is not None:
            self.admission.published(len(items) * self.block_bytes)
        if self.events.enabled:
            self._emit_stored(items, request)

    def _emit_stored(self, items: list[tuple[int, int, int]], request: Request) -> None:
        """One BlockStored per run of consecutive table indices."""
        run: list[Any] = []
        first = prev = -2
        for j, _, h in items:
            if j != prev + 1 and run:
                self._stored_event(first, run, request)
                run = []
            if not run:
                first = j
            run.append(h)
            prev = j
        if run:
            self._stored_event(first, run, request)

    def _stored_event(self, first: int, run: list[Any], request: Request) -> None:
        parent: Any = request.block_hashes[first * self.stride - 1] if first else None
        size = self.block_size
        tokens = tuple(request.token_ids[first * size : (first + len(run)) * size])
        self.events.stored(self.group_id, tuple(run), parent, size, tokens, request.lora_id)

    # -- free ---------------------------------------------------------------------------------
    @abstractmethod
    def release_all(self, st: GroupState, request: Request) -> None:
        """Publish what is computed, then drop every reference ``st`` holds (tail first)."""

    def protect(self, hashes: Sequence[int], marks: Sequence[int]) -> None:  # noqa: B027
        """After a free: re-age the cached blocks a hit at each position in ``marks`` needs.

        Windowed and state kinds act (full attention keeps every block until the free, so its
        blocks are already recent): their blocks leave the request (and enter the LRU) long
        before it ends, so without this the window or checkpoint at a shared prefix's end
        would be evicted long before the prefix itself.  ``marks`` are the request's hit,
        its junction and its computed end.
        """

    def drop_unread(
        self,
        st: GroupState,
        num_tokens: int,
        missing: Sequence[tuple[int, int]] = (),
        start: int = 0,
    ) -> list[int]:
        """Null and free (unpublished) the blocks ``st`` took fresh at its allocation that no
        query at a position >= ``num_tokens`` reads; returns them.  Only windowed kinds have
        such blocks (see :meth:`KVCacheManager.drop_unread`).  ``missing``: token ranges the
        import will not write (checked first with :meth:`unwritable`); windowed kinds
        withhold the blocks past the hit (``start`` tokens) holding any of them from
        publication."""
        return []

    def unwritable(
        self, st: GroupState, start: int, num_tokens: int, missing: Sequence[tuple[int, int]]
    ) -> tuple[int, str] | None:
        """The first token of ``missing`` in ``[start, num_tokens)`` that the import must
        write, and why (some query at a position >= ``num_tokens`` reads it: every one, here;
        or a block holding it is published already), or None when there is none."""
        for a, b in missing:
            if max(a, start) < min(b, num_tokens):
                return max(a, start), f"a query at or after {num_tokens} reads it"
        return None

    @abstractmethod
    def held_blocks(self, st: GroupState) -> list[int]:
        """Every block ``st`` references (one entry per reference)."""

    def table(self, st: GroupState) -> list[int]:
        """The block table the model runner uses for this group."""
        return st.table

    def check_request(self, st: GroupState, request: Request) -> None:
        """Raise InvariantError when ``st`` is inconsistent with ``request``."""
        if st.num_cached > len(st.table):
            raise InvariantError(
                f"group {self.group_id}, request {request.request_id}: num_cached "
                f"{st.num_cached} > table length {len(st.table)}"
            )
        hashes = request.block_hashes
        for j, b in enumerate(st.table[: st.num_cached]):
            h = self.block_hashes[b] if b else None
            if h is not None and h != hashes[(j + 1) * self.stride - 1]:
                raise InvariantError(
                    f"group {self.group_id}, request {request.request_id}: block {b} at "
                    f"index {j} holds another prefix's hash"
                )
