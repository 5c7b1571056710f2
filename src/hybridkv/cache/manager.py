"""The public cache manager: what an engine's scheduler calls.

Shaped like vLLM v1's ``KVCacheManager``, generalised to any number of groups::

    mgr = KVCacheManager(layout)
    req = mgr.make_request("r0", prompt_token_ids)
    hit = mgr.get_computed_blocks(req)                      # reads only
    n = req.num_tokens - hit.num_computed_tokens            # or a chunk of it
    res = mgr.allocate_slots(req, n, num_new_computed_tokens=hit.num_computed_tokens,
                             new_computed_blocks=hit)       # None: not enough blocks
    req.num_computed_tokens = hit.num_computed_tokens       # the scheduler counts the hit
    # ... run the step (state copies: hybridkv.cache.kinds.state), then:
    req.num_computed_tokens += n
    req.append_token_ids([sampled])
    res = mgr.allocate_slots(req, 1)                        # decode one token
    mgr.free(req.request_id)                                # finished

Request lifecycle: a :class:`Request` is *known* from its first successful
``allocate_slots`` until ``free``.  ``preempt`` drops its blocks (publishing what is computed)
and resets ``num_computed_tokens`` to 0; it may then be admitted again from
``get_computed_blocks``.  ``free`` marks it finished for good.

Every call that raises leaves all state unchanged; ``allocate_slots`` returning None also
changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hybridkv.cache.arguments import (
    check_computed_blocks,
    check_count,
    check_group_id,
    check_index,
    check_request_id,
    check_tier_specs,
)
from hybridkv.cache.compaction import compact_for
from hybridkv.cache.coordinator import HybridCoordinator
from hybridkv.cache.errors import (
    LayoutMismatchError,
    RequestLengthError,
    StaleComputedBlocksError,
    UnknownRequestError,
)
from hybridkv.cache.events import EventLog, KVEvent
from hybridkv.cache.hashing import BlockHasher, HasherError, make_hasher
from hybridkv.cache.imports import drop_unread
from hybridkv.cache.manager_tiers import TierCalls
from hybridkv.cache.pool_base import DEFAULT_CHANCES, BlockPool, check_chances
from hybridkv.cache.request import MultiModalItem, Request
from hybridkv.cache.stats import PrefixCacheStats, StatsCollector
from hybridkv.cache.tier_sessions import DEFAULT_PROTECT_SHARE
from hybridkv.cache.tiers import TierSpec
from hybridkv.cache.types import AllocationResult, BlockMove, ComputedBlocks
from hybridkv.errors import InvariantError, PlanError, RequestError, brief_repr
from hybridkv.plan.layout import MemoryLayout

__all__ = ["KVCacheManager"]


class KVCacheManager(TierCalls):
    """Block bookkeeping and prefix caching for every group of a :class:`MemoryLayout`.

    ``hasher``: a :class:`BlockHasher` or a name (``"xxh3"`` default, ``"sha256"``, ``"builtin"``).
    ``enable_kv_events``: record :mod:`hybridkv.cache.events` for :meth:`take_events`.
    ``max_model_len``: slots are never allocated past it (lookahead is clipped).
    ``arena_eviction``: ``"chunk_lru"`` (default) or ``"own_first"`` for arena layouts (see
    :mod:`hybridkv.cache.pool_arena`).
    ``eviction``: ``"lru"`` (default) or ``"2q"``, the order of the free-list pools (the
    ``uniform`` and ``pools`` strategies, and arenas run on them: every group's block the
    chunk, or one group); 2Q keeps blocks used once on a short probation and admits to the
    main LRU only blocks that served a hit or came back soon after their eviction (see
    :class:`~hybridkv.cache.pool_freelist.FreeListPool`).  The chunked arena refuses it.
    ``second_chance``: the chances a cached block holds at most (default 1, ``True`` / ``False``
    = 1 / 0): each hit it serves gives it one, and a block (or an idle arena chunk holding
    one) that has one when it comes up for eviction spends it and moves to the young end
    instead (CLOCK's second chance; above 1, generalized CLOCK's hit counter; see
    :class:`~hybridkv.cache.pool_freelist.FreeListPool` and :mod:`hybridkv.cache.pool_arena`).
    ``window_chances``: the same cap for the blocks of windowed groups (sliding window, local
    chunks); None (default): ``max(second_chance, 2)``, or 0 when ``second_chance`` is 0 (see
    :data:`~hybridkv.cache.pool_base.DEFAULT_WINDOW_CHANCES` for why and what it measured).
    ``publish``: ``"scheduled"`` (default): attention blocks join the prefix cache at the
    allocation of the step that fills them, so requests admitted later in the same step hit
    them; the runner must write a step's new tokens before reading them (hybridkv's engine
    orders its passes so).  ``"computed"``: only once reported computed.  See
    :data:`hybridkv.cache.coordinator.PUBLISH_MODES`.
    ``window_retention``: ``"tails"`` (default) publishes only the sliding-window / local-chunk
    blocks a hit at a likely position reads; ``"all"`` every computed one (see
    :data:`hybridkv.cache.coordinator.WINDOW_RETENTION`).
    ``group_hit_stats``: also find every group's standalone hit per query, for
    :attr:`PrefixCacheStats.group_alone_hit_tokens` (off by default: it scans each windowed
    group over the whole prompt, where the hit itself only needs the part below the
    prefix-closed groups' hit; with it off that field is empty).
    ``checkpoint_admission``: which recurrent-state checkpoints are saved: ``"yield"``
    (default) those whose reason (junction, prompt end, prefill chunk end, decode) has served
    at least the cache's average hit tokens per byte; ``"all"``: every aligned step end.  See
    :mod:`hybridkv.cache.admission` and :meth:`checkpoint_admission_report`.
    ``dead_tails``: ``"drop"`` a freed request's attention blocks that no hit can read now
    (past the longest hit its tokens have: no state checkpoint or window serves them) and no
    other request read, ``"keep"`` them under LRU, or ``"auto"`` (default): drop without
    lower tiers, keep with them (see :mod:`hybridkv.cache.dead_tails`).
    ``checkpoint_life``: ``"kv"``: a recurrent-state checkpoint lives as long as the KV it ends
    (refreshed when its request frees its blocks, dropped once the prefix-closed block ending
    where it does leaves the device); ``"alone"``: it ages from its publication and is
    evicted in its own turn; ``"auto"`` (default): ``kv`` without lower tiers, ``alone`` with
    them (see :data:`hybridkv.cache.policies.CHECKPOINT_LIFE`).
    ``tiers``: lower cache tiers (:class:`~hybridkv.cache.tiers.TierSpec`, ``host`` then
    ``disk``) that blocks the device evicts are written back to; a hit on them allocates
    device blocks and returns :attr:`AllocationResult.loads` (see :mod:`hybridkv.cache.tiers`
    and :meth:`tier_stats`).  ``tier_ops``: also record the storage operations the tiers
    need (stores of evicted blocks, loads, moves, drops) for :meth:`take_tier_ops`.
    ``tier_admission``: ``"yield"`` (default): a state checkpoint the device evicts whose
    reason the checkpoint admission would not save now skips the host tier (to the disk tier,
    if any, else dropped); ``"all"``: it goes to the top tier as any block (see
    :data:`hybridkv.cache.admission.TIER_ADMISSION`).
    ``tier_write_through``: the name of a tier (``host`` or ``disk``) that also takes every
    block the device publishes, once the step computing it ran (:meth:`write_through`; the
    scheduler calls it after each step), not only when the device evicts it: evictions then
    find most blocks stored already, and a disk tier holds a process's prefixes even if it
    ends without :meth:`persist_to_tier`.  None (default): write-back on eviction only.
    ``checkpoint_when_full``: what a step does when the cache cannot also hold the state
    checkpoint it would save: ``"refuse"`` the allocation, ``"skip_minor"`` (skip it on a
    running request's step unless it sits at a junction or a prompt's end) or ``"skip"`` it;
    None (default): by layout, ``skip_minor`` for ``arena``, ``refuse`` for ``uniform``,
    ``skip`` for ``pools`` (see :data:`~hybridkv.cache.admission.CHECKPOINT_WHEN_FULL`).
    """

    #: Skip planning an allocation that provably changes nothing (see
    #: :meth:`~hybridkv.cache.kinds.base.KindManager.quiet_end`); False only to test that the
    #: fast path and the full path agree.
    fast_path: bool = True

    def __init__(
        self,
        layout: MemoryLayout,
        *,
        hasher: BlockHasher | str = "xxh3",
        enable_kv_events: bool = False,
        max_model_len: int | None = None,
        arena_eviction: str = "chunk_lru",
        eviction: str = "lru",
        second_chance: int = DEFAULT_CHANCES,
        window_chances: int | None = None,
        publish: str = "scheduled",
        window_retention: str = "tails",
        group_hit_stats: bool = False,
        checkpoint_admission: str = "yield",
        tiers: Sequence[TierSpec] = (),
        tier_ops: bool = False,
        tier_admission: str = "yield",
        tier_write_through: str | None = None,
        checkpoint_when_full: str | None = None,
        protect_share: float = DEFAULT_PROTECT_SHARE,
        dead_tails: str = "auto",
        checkpoint_life: str = "auto",
    ) -> None:
        if not isinstance(layout, MemoryLayout):
            raise LayoutMismatchError(f"layout: expected a MemoryLayout, got {type(layout)}")
        if max_model_len is not None and check_count("max_model_len", max_model_len) < 1:
            raise RequestLengthError(
                "max_model_len: must be a positive integer (or None: no limit), got 0"
            )
        tiers = check_tier_specs(tiers)
        given_hasher: object = hasher  # checked as an object: the compiled build too
        if not isinstance(given_hasher, (BlockHasher, str)):
            raise HasherError(
                f"hasher: expected a BlockHasher or a name (xxh3, sha256, builtin), "
                f"got {brief_repr(given_hasher)}"
            )
        second_chance = check_chances(second_chance)  # here too: before any typed (compiled) call
        if window_chances is not None:
            window_chances = check_chances(window_chances, "window_chances")
        if tier_write_through is not None and not tiers:
            raise PlanError(
                f"tier_write_through: {tier_write_through!r} names a tier, but this cache has "
                "no lower tiers (give tiers=[TierSpec(...)])"
            )
        self.layout = layout
        self.hasher = make_hasher(hasher) if isinstance(hasher, str) else hasher
        self.max_model_len = max_model_len
        self._events = EventLog(enabled=enable_kv_events)
        self._coord = HybridCoordinator(
            layout,
            events=self._events,
            max_model_len=max_model_len,
            arena_eviction=arena_eviction,
            eviction=eviction,
            second_chance=second_chance,
            window_chances=window_chances,
            publish=publish,
            window_retention=window_retention,
            checkpoint_admission=checkpoint_admission,
            tiers=tiers,
            tier_ops=tier_ops,
            tier_admission=tier_admission,
            tier_write_through=tier_write_through,
            checkpoint_when_full=checkpoint_when_full,
            protect_share=protect_share,
            dead_tails=dead_tails,
            checkpoint_life=checkpoint_life,
        )
        self.group_hit_stats = bool(group_hit_stats)
        self._stats = StatsCollector(len(layout.groups) if group_hit_stats else 0)
        self._known: dict[str, Request] = {}
        self.hash_block_size = layout.hash_block_size
        self.schedule_alignment = layout.schedule_alignment
        self.num_groups = len(layout.groups)

    # -- requests ---------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt_token_ids: Iterable[int],
        *,
        lora_id: int | str | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultiModalItem | tuple[str, int, int]] = (),
    ) -> Request:
        """A :class:`Request` hashed the way this manager expects (nothing is allocated)."""
        return Request(
            request_id,
            prompt_token_ids,
            hash_block_size=self.hash_block_size,
            hasher=self.hasher,
            lora_id=lora_id,
            cache_salt=cache_salt,
            mm_items=mm_items,
        )

    # -- the scheduler's calls --------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest prefix-cache hit for ``request``'s tokens.

        Mutates no ref count or cache (only the statistics count the query).  The hit is a
        multiple of ``schedule_alignment`` and below ``request.num_tokens``.  Raises
        :class:`RequestError` subclasses for a finished or mismatched request.
        """
        self._check_request(request)
        hit = self._coord.find_hit(request, self.group_hit_stats)
        self._stats.record_query(
            request.num_tokens, hit.length, hit.alone if self.group_hit_stats else None
        )
        return ComputedBlocks(self._coord.hit_blocks(request, hit.length), hit.length, hit.junction)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        *,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_reserved_tokens: int = 0,
    ) -> AllocationResult | None:
        """Reserve slots for a step computing ``num_new_tokens`` more tokens of ``request``.

        Slots cover ``request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        + num_lookahead_tokens`` tokens (lookahead: speculative draft positions).
        ``num_reserved_tokens``: the prefix-closed groups (full attention, MLA), which keep
        every block while the request lives, also take the blocks of that many tokens past
        the step now (a scheduler reserves the rest of a prompt at admission, so its later
        prefill chunks need no blocks there and cannot be refused for them); other kinds
        allocate step by step (a sliding window would hold blocks it releases before it
        reaches them).  Reserved blocks are not published until computed.  On a
        request's first allocation, ``new_computed_blocks`` (from :meth:`get_computed_blocks`,
        with ``num_new_computed_tokens`` equal to its ``num_computed_tokens``) is taken as the
        cached prefix.  Windowed kinds release blocks no future query can see before new ones
        are taken; computed blocks are published to the prefix cache.

        Returns None, changing nothing, when the blocks do not fit.  Raises (changing nothing)
        :class:`RequestLengthError` for counts that do not match the request,
        :class:`FinishedRequestError`, :class:`LayoutMismatchError`,
        :class:`StaleComputedBlocksError` or :class:`DuplicateRequestError`.
        """
        coord = self._coord
        rs = coord.requests.get(getattr(request, "request_id", ""))
        if (  # the decode fast path: nothing to plan below the request's quiet bound
            self.fast_path
            and rs is not None
            and rs.request is request
            and new_computed_blocks is None
            and type(num_new_tokens) is int
            and type(num_new_computed_tokens) is int
            and type(num_lookahead_tokens) is int
            and type(num_reserved_tokens) is int
            and not num_new_computed_tokens
            and not num_lookahead_tokens
            and num_new_tokens >= 0
            and not request.is_finished
        ):
            computed = request.num_computed_tokens
            end = computed + num_new_tokens
            if (
                rs.min_computed <= computed <= rs.num_slots
                and end <= rs.quiet
                and computed <= rs.quiet_computed
                and end <= request.num_tokens
                and (not num_reserved_tokens or 0 < num_reserved_tokens <= rs.num_reserved - end)
            ):
                if end > rs.num_slots:
                    rs.num_slots = end
                    if end > rs.num_reserved:
                        rs.num_reserved = end
                rs.min_computed = computed
                return coord.nothing
        if not (
            type(num_new_tokens) is int
            and type(num_new_computed_tokens) is int
            and type(num_lookahead_tokens) is int
            and type(num_reserved_tokens) is int
            and num_new_tokens >= 0
            and num_new_computed_tokens >= 0
            and num_lookahead_tokens >= 0
            and num_reserved_tokens >= 0
        ):
            check_count("num_new_tokens", num_new_tokens)
            check_count("num_new_computed_tokens", num_new_computed_tokens)
            check_count("num_lookahead_tokens", num_lookahead_tokens)
            check_count("num_reserved_tokens", num_reserved_tokens)
        if new_computed_blocks is not None and not isinstance(new_computed_blocks, ComputedBlocks):
            raise RequestError(
                "new_computed_blocks: expected the ComputedBlocks get_computed_blocks returned "
                f"(or None), got {brief_repr(new_computed_blocks)}"
            )
        if rs is None or rs.request is not request or request.is_finished:
            self._check_request(request)  # raises for anything but a first allocation
        rid = request.request_id
        computed = request.num_computed_tokens
        hit: tuple[tuple[int, ...], ...] | None = None
        if rs is None:
            if computed:
                raise RequestLengthError(
                    f"request {rid!r}: num_computed_tokens is {computed} but it holds no blocks "
                    "(new or preempted requests start from 0)"
                )
            hit = self._check_hit(request, num_new_computed_tokens, new_computed_blocks)
        else:
            if num_new_computed_tokens or (
                new_computed_blocks is not None and new_computed_blocks.num_computed_tokens
            ):
                raise RequestLengthError(
                    f"request {rid!r}: num_new_computed_tokens={num_new_computed_tokens}; cache "
                    "hits are only taken on a request's first allocation"
                )
            if not rs.min_computed <= computed <= rs.num_slots:
                raise RequestLengthError(
                    f"request {rid!r}: num_computed_tokens {computed} must lie in "
                    f"[{rs.min_computed}, {rs.num_slots}] (last allocation's start, its slots)"
                )
        end = computed + num_new_computed_tokens + num_new_tokens
        if end > request.num_tokens:
            raise RequestLengthError(
                f"request {rid!r}: num_computed_tokens {computed} + num_new_computed_tokens "
                f"{num_new_computed_tokens} + num_new_tokens {num_new_tokens} = {end} exceeds "
                f"its {request.num_tokens} tokens"
            )
        if self.max_model_len is not None and end > self.max_model_len:
            raise RequestLengthError(
                f"request {rid!r}: {end} tokens exceed max_model_len {self.max_model_len}"
            )
        junction = new_computed_blocks.junction_tokens if new_computed_blocks else 0
        result = coord.allocate(
            rs,
            request,
            num_new_tokens,
            num_new_computed_tokens,
            hit,
            num_lookahead_tokens,
            junction,
            num_reserved_tokens,
        )
        if result is not None and rs is None:
            self._known[rid] = request
        return result

    def _check_hit(
        self, request: Request, length: int, blocks: ComputedBlocks | None
    ) -> tuple[tuple[int, ...], ...] | None:
        rid = request.request_id
        if blocks is None:
            if length:
                raise RequestLengthError(
                    f"request {rid!r}: num_new_computed_tokens={length} needs the "
                    "new_computed_blocks get_computed_blocks returned"
                )
            return None
        check_computed_blocks(rid, request.num_tokens, blocks)
        if blocks.num_computed_tokens != length:
            raise RequestLengthError(
                f"request {rid!r}: num_new_computed_tokens={length} but new_computed_blocks "
                f"covers {blocks.num_computed_tokens} tokens"
            )
        if not length:
            return None
        if len(blocks.blocks) != self.num_groups:
            raise LayoutMismatchError(
                f"request {rid!r}: new_computed_blocks has {len(blocks.blocks)} groups, the "
                f"layout {self.num_groups}"
            )
        if length % self.schedule_alignment or length >= request.num_tokens:
            raise RequestLengthError(
                f"request {rid!r}: a hit of {length} tokens must be a multiple of "
                f"{self.schedule_alignment} below the request's {request.num_tokens} tokens"
            )
        hashes = request.block_hashes
        for m, group_blocks in zip(self._coord.managers, blocks.blocks, strict=True):
            err = m.hit_error(hashes, length, group_blocks)
            if err is not None:
                raise StaleComputedBlocksError(f"request {rid!r}: {err}")
        return blocks.blocks

    def free(self, request_id: str) -> None:
        """Finish ``request_id``: publish its computed blocks, drop its references, mark the
        Request finished.  Raises :class:`UnknownRequestError` for an id with no allocation."""
        check_request_id("free", request_id)
        rs = self._coord.release(request_id)
        request = rs.request if rs is not None else self._known.get(request_id)
        if request is None:
            raise UnknownRequestError(f"free: no allocated request has id {request_id!r}")
        del self._known[request_id]
        request.is_finished = True

    def preempt(self, request_id: str) -> None:
        """Drop every block of ``request_id`` (publishing computed ones) and set its
        ``num_computed_tokens`` to 0 so it can be admitted again.  Raises
        :class:`UnknownRequestError` when it holds no blocks."""
        check_request_id("preempt", request_id)
        rs = self._coord.release(request_id)
        if rs is None:
            raise UnknownRequestError(f"preempt: request {request_id!r} holds no blocks")
        rs.request.num_computed_tokens = 0
        self._stats.record_preemption()

    def compact(
        self,
        request: Request,
        num_new_tokens: int,
        *,
        num_lookahead_tokens: int = 0,
        pinned: Iterable[str] = (),
    ) -> tuple[BlockMove, ...]:
        """Make room for running ``request``'s next step (the ``allocate_slots`` call that was
        just refused) by freeing whole arena chunks: the referenced blocks of sparse chunks
        move into their group's free slots, evicting that group's cached blocks in LRU order where
        needed (:mod:`~hybridkv.cache.compaction`), up to the chunks the step lacks.  Returns
        ``()``, changing nothing, when it can free no chunk (then preempt) and for a pool
        without chunks.  Otherwise the moves, in order (try the step again; compact again
        while it is refused and this moves blocks): copy each block's bytes before the next
        step reads or writes them, and re-read every request's tables (:meth:`get_block_ids`);
        a :class:`ComputedBlocks` not yet allocated is stale.  With ``tier_ops`` the moves are
        also ``relocate`` operations of :meth:`take_tier_ops`, in stream order: storage that
        runs that stream copies them there instead.
        ``pinned``: ids of requests whose blocks must stay where they are (their tables were
        handed to someone else, e.g. a finished request held for a handover).
        Raises :class:`UnknownRequestError` when ``request`` holds no blocks and
        :class:`RequestLengthError` for counts past its tokens."""
        check_count("num_new_tokens", num_new_tokens)
        check_count("num_lookahead_tokens", num_lookahead_tokens)
        given: object = pinned  # checked as an object: the compiled build too
        if isinstance(given, (str, bytes)) or not isinstance(given, Iterable):
            raise RequestError(
                f"compact: pinned must be a collection of request ids, got {brief_repr(given)}"
            )
        pinned = tuple(pinned)
        for rid_pinned in pinned:
            check_request_id("compact: pinned", rid_pinned)
        rid = getattr(request, "request_id", None)
        rs = self._coord.requests.get(rid) if isinstance(rid, str) else None
        if rs is None or rs.request is not request:
            raise UnknownRequestError(f"compact: request {rid!r} holds no blocks")
        end = request.num_computed_tokens + num_new_tokens
        if end > request.num_tokens:
            raise RequestLengthError(
                f"compact: request {rid!r}: num_new_tokens {num_new_tokens} runs past its "
                f"{request.num_tokens} tokens from {request.num_computed_tokens} computed"
            )
        moves = compact_for(self._coord, rs, num_new_tokens, num_lookahead_tokens, pinned)
        if moves:
            self._stats.record_compaction(len(moves))
        return moves

    # -- queries ------------------------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """Per group, a copy of the request's block table (state groups: ``[running slot]``)."""
        check_request_id("get_block_ids", request_id)
        rs = self._coord.requests.get(request_id)
        if rs is not None:
            return self._coord.block_ids(rs)
        if request_id in self._known:
            return tuple([] for _ in range(self.num_groups))
        raise UnknownRequestError(f"get_block_ids: no allocated request has id {request_id!r}")

    @property
    def pool(self) -> BlockPool:
        """The block pool (read-only use: ref counts, hashes, chunk owners for storage)."""
        return self._coord.pool

    def drop_unread(
        self,
        request_id: str,
        num_tokens: int,
        *,
        missing: Mapping[int, Sequence[tuple[int, int]]] | None = None,
    ) -> int:
        """Tokens ``[0, num_tokens)`` of ``request_id`` were computed elsewhere and are being
        imported (a disaggregated prefill's handover): in windowed groups (sliding window,
        local chunks), null the blocks its allocation took fresh that no query at a position
        >= ``num_tokens`` reads, and free them unpublished, as a prefix hit of ``num_tokens``
        tokens would not have held them.  Call it after that allocation and before its data
        is written.  Blocks already published (``publish="scheduled"``) or hit are kept.
        ``missing``: per group, token ranges ``[start, end)`` the import will not write (the
        exporting side released them); the blocks past the hit holding any are never
        published.  Returns how many blocks were freed (:mod:`hybridkv.cache.imports`).
        Raises :class:`UnknownRequestError` (no blocks held), :class:`RequestLengthError`
        (``num_tokens`` outside ``[num_computed_tokens, allocated slots]``, a malformed
        ``missing``) and :class:`UnwrittenTokensError` (a missing token past the hit that a
        query at or after ``num_tokens`` reads, or in a published block); none changes
        anything."""
        return drop_unread(self._coord, request_id, num_tokens, missing)

    def has_blocks(self, request_id: str) -> bool:
        """True while ``request_id`` holds blocks (allocated, not freed or preempted).  Raises
        :class:`UnknownRequestError` for an id that is not a ``str``."""
        check_request_id("has_blocks", request_id)
        return request_id in self._coord.requests

    @property
    def usage(self) -> float:
        """Fraction of allocatable memory held by referenced blocks (0.0 .. 1.0)."""
        return self._coord.pool.usage

    @property
    def used_bytes(self) -> int:
        """Bytes held by referenced blocks (what :attr:`usage` is the fraction of)."""
        return self._coord.pool.used_bytes

    @property
    def num_free_blocks(self) -> tuple[int, ...]:
        """Per group, blocks it alone could take now (free, evictable or in free chunks)."""
        pool = self._coord.pool
        return tuple(pool.num_free(g) for g in range(self.num_groups))

    def is_allocated(self, group_id: int, block_id: int) -> bool:
        """True iff block ``block_id`` of group ``group_id`` is referenced by some request
        (False for an id no block of the group has).  Raises :class:`LayoutMismatchError` for
        a ``group_id`` that is not a group of the layout, or ids that are not integers."""
        group_id = check_group_id("is_allocated", group_id, self.num_groups)
        block_id = check_index("is_allocated", "block_id", block_id)
        return self._coord.pool.is_allocated(group_id, block_id)

    def chunk_owner(self, chunk: int) -> int | None:
        """Arena layouts: the group holding ``chunk``, None when free.  Raises
        :class:`LayoutMismatchError` for a chunk the arena does not have, or a layout without
        chunks."""
        return self._coord.pool.chunk_owner(check_index("chunk_owner", "chunk", chunk))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix.  Only while no request holds blocks; returns False
        (changing nothing) otherwise.  Emits AllBlocksCleared."""
        ok = self._coord.reset_prefix_cache()
        if ok:
            self._stats.record_reset()
        return ok

    def checkpoint_admission_report(self) -> dict[str, dict[str, float | bool]] | None:
        """Per checkpoint reason: checkpoints and bytes on record, hit tokens served, yield
        relative to the cache's average and whether it is admitted now (None: the layout has
        no state group, or the policy is ``"all"``)."""
        adm = self._coord.admission
        return None if adm is None else adm.report()

    @property
    def stats(self) -> PrefixCacheStats:
        """Prefix-cache statistics since the manager was built."""
        return self._stats.total()

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Prefix-cache statistics since the previous call (starts a new interval)."""
        return self._stats.take()

    def take_events(self) -> list[KVEvent]:
        """Drain the KV events recorded since the last call (empty when events are off)."""
        return self._events.take()

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` if any structure is inconsistent (a hybridkv bug)."""
        self._coord.check_invariants()
        for rid in self._coord.requests:
            request = self._known.get(rid)
            if request is None or request.is_finished:
                raise InvariantError(f"request {rid!r} holds blocks but is not known and live")

    def snapshot(self) -> Any:
        """A deep, comparable copy of all state (a testing aid for atomicity checks)."""
        known = sorted((rid, r.num_computed_tokens) for rid, r in self._known.items())
        return (self._coord.snapshot(), known, self._stats.total())
