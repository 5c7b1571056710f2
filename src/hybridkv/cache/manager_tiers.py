"""The cache manager's calls on the lower tiers (host, disk) and client sessions.

:class:`TierCalls` is the base of :class:`~hybridkv.cache.manager.KVCacheManager` that holds
them (storage operations, write-through, retained hits, copies storage found bad, persistent
tiers, protected sessions), so the manager's module keeps the scheduler's calls.  It also
checks the requests both kinds of call take.  Bookkeeping only: see
:mod:`hybridkv.cache.tiers` and :mod:`hybridkv.cache.tier_sessions`.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.cache.arguments import check_group_id, check_index, check_request_id
from hybridkv.cache.coordinator import HybridCoordinator
from hybridkv.cache.errors import (
    DuplicateRequestError,
    FinishedRequestError,
    LayoutMismatchError,
    UnknownRequestError,
)
from hybridkv.cache.hashing import BlockHasher
from hybridkv.cache.request import Request
from hybridkv.cache.tiers import TierOp
from hybridkv.cache.types import ComputedBlocks
from hybridkv.errors import PlanError, RequestError, StorageError, brief_repr

__all__ = ["TierCalls"]


class TierCalls:
    """Lower-tier and session calls of a cache manager (set up by its ``__init__``)."""

    _coord: HybridCoordinator
    _known: dict[str, Request]
    hasher: BlockHasher
    hash_block_size: int
    num_groups: int

    def _check_request(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise RequestError(f"request: expected a Request, got {type(request).__name__}")
        rid = request.request_id
        if request.is_finished:
            raise FinishedRequestError(f"request {rid!r} was freed (finished); make a new one")
        if request.hash_block_size != self.hash_block_size:
            raise LayoutMismatchError(
                f"request {rid!r}: hash_block_size {request.hash_block_size} differs from the "
                f"layout's {self.hash_block_size}; build requests with make_request()"
            )
        if request.hasher is not self.hasher and request.hasher != self.hasher:
            raise LayoutMismatchError(
                f"request {rid!r}: hashed with {request.hasher!r}, the manager uses "
                f"{self.hasher!r}; build requests with make_request()"
            )
        known = self._known.get(rid)
        if known is not None and known is not request:
            raise DuplicateRequestError(f"request id {rid!r} already names another Request")

    def protect(self, request_id: str, session: str) -> int:
        """Keep what live request ``request_id`` has computed in the lower tiers ahead of
        other entries, under ``session`` (replacing what it protected before), until
        :meth:`unprotect` (see :mod:`hybridkv.cache.tier_sessions`).  Call before
        :meth:`free`.  Protected entries fill at most ``protect_share`` of each tier: past it
        the least recently protected sessions end (this one too, if it alone is over).
        Returns the block hashes protected; raises :class:`UnknownRequestError` for an id
        that is not live, and :class:`RequestError` for a ``session`` that is not a non-empty
        ``str``."""
        check_request_id("protect", request_id)
        if not isinstance(session, str) or not session:
            raise RequestError(
                f"protect: session must be a non-empty str naming the client session, "
                f"got {brief_repr(session)}"
            )
        request = self._known.get(request_id)
        if request is None:
            raise UnknownRequestError(f"protect: no live request has id {request_id!r}")
        hashes = request.block_hashes[: request.num_computed_tokens // self.hash_block_size]
        sessions = self._coord.sessions
        sessions.protect(session, hashes)
        sessions.enforce(session)
        return len(hashes)

    def unprotect(self, session: str) -> bool:
        """End ``session`` (see :meth:`protect`): its entries are evicted first.  Returns
        whether the session existed (False, too, for one that ended because the tiers held
        more protected bytes than their share).  Raises :class:`RequestError` for a
        ``session`` that is not a ``str``."""
        if not isinstance(session, str):
            raise RequestError(
                f"unprotect: session must be a str naming a session, got {brief_repr(session)}"
            )
        return self._coord.sessions.unprotect(session)

    def session_stats(self) -> dict[str, int]:
        """Protected sessions now, the block hashes they protect, and how many sessions
        ended because a tier held more protected bytes than its ``protect_share`` or the
        sessions protected more hashes than the device and those shares could hold."""
        sessions = self._coord.sessions
        return {
            "sessions": len(sessions.sessions),
            "protected_hashes": len(sessions.counts),
            "expired": sessions.expired,
        }

    def take_tier_ops(self) -> list[TierOp]:
        """The tier storage operations since the last call, in the order they must run
        (empty without tiers or ``tier_ops``); run them before the step's model pass."""
        tiers = self._coord.tiers
        return [] if tiers is None else tiers.take_ops()

    def write_through(self) -> int:
        """The steps scheduled so far ran: store the blocks they published in the
        ``tier_write_through`` tier (operations for :meth:`take_tier_ops`).  Returns how many
        blocks were offered to it (0 without write-through)."""
        bridge = self._coord.bridge
        if bridge is None or bridge.write_through is None:
            return 0
        offered = bridge.flush_through()
        self._coord.sessions.enforce()
        return offered

    def retain_hit(self, request: Request) -> int:
        """``request`` joined a waiting queue: make the lower-tier entries its prefix hit
        would read now the most recently used of their tiers, so the wait does not cost the
        hit (a queue of tens of seconds outlasts the young end of a host tier under load).
        Device blocks need nothing: an eviction writes them back to the host tier's young
        end.  Moves no bytes, takes no reference, publishes nothing; returns how many
        entries moved (0 without tiers).

        Measured on the Mooncake conversation trace (``simulate``, first 2,000 requests,
        16 GiB device + 128 GiB host, TTFT p50 ~30 s): Qwen3-Next-80B-A3B 15.5% -> 18.2% of
        prompt tokens from the cache; gpt-oss-20b (no queue to speak of) 20.5% -> 20.6%."""
        self._check_request(request)
        moved = self._coord.retain(request)
        self._coord.sessions.enforce()  # a cold protected copy it warmed now counts
        return moved

    def tier_blocks(self, request: Request, computed: ComputedBlocks) -> list[tuple[int, int, str]]:
        """``(group, hash, tier)`` of each block of ``computed`` (from
        :meth:`get_computed_blocks`) that its allocation would read back from a lower tier.
        Storage that must check a copy before it is used (a disk tier's checksums) checks
        these, and :meth:`discard_tier_block` the bad ones, before the allocation.  Reads
        only.  Raises :class:`RequestError` subclasses for a bad ``request`` or a ``computed``
        that is not a :class:`ComputedBlocks`."""
        self._check_request(request)
        given: object = computed  # checked as an object: the compiled build too
        if not isinstance(given, ComputedBlocks):
            raise RequestError(
                "tier_blocks: computed must be the ComputedBlocks get_computed_blocks returned, "
                f"got {brief_repr(given)}"
            )
        return self._coord.tier_blocks(request, computed.blocks, computed.num_computed_tokens)

    def discard_tier_block(self, group_id: int, block_hash: int) -> bool:
        """Storage found the lower-tier copy of ``block_hash`` of group ``group_id`` unusable
        (a failed write, a truncated or corrupt copy): forget it, so no hit reads it (a
        ``drop`` operation and a tier event follow).  Returns whether a tier held it; False,
        changing nothing, without tiers.  Raises :class:`LayoutMismatchError` for a
        ``group_id`` that is not a group of the layout or a ``block_hash`` that is not an
        integer."""
        group_id = check_group_id("discard_tier_block", group_id, self.num_groups)
        block_hash = check_index("discard_tier_block", "block_hash", block_hash)
        tiers = self._coord.tiers
        if tiers is None:
            return False
        return tiers.discard(group_id, block_hash)

    def drop_tier_copy(self, tier: str, group_id: int, block_hash: int) -> bool:
        """Tier ``tier``'s storage cannot keep its copy of ``block_hash`` of group ``group_id``
        (no room where it keeps its bytes): forget that copy only, as an eviction would
        (counted as dropped; a copy in another tier stays; a ``drop`` operation and a tier
        event follow).  Returns whether the tier held it; False, changing nothing, without
        tiers.  Raises :class:`PlanError` for a tier this manager does not have and
        :class:`LayoutMismatchError` for a bad ``group_id`` or ``block_hash``."""
        group_id = check_group_id("drop_tier_copy", group_id, self.num_groups)
        block_hash = check_index("drop_tier_copy", "block_hash", block_hash)
        tiers = self._coord.tiers
        if tiers is None:
            return False
        return tiers.drop_copy(tier, group_id, block_hash)

    def adopt_tier_entries(self, tier: str, entries: Sequence[tuple[int, int, int]]) -> list[int]:
        """Take ``(group, hash, tag)`` entries that tier ``tier``'s storage already holds (a
        persistent disk tier left by an earlier process), oldest first, as cached there.
        Returns the indices of those adopted; the others found no room or repeat a hash, and
        storage should free them.  Raises :class:`PlanError` without such a tier and
        :class:`StorageError` for an entry that is not three integers, adopting nothing."""
        tiers = self._coord.tiers
        if tiers is None:
            raise PlanError(f"tier {tier!r}: this manager has no lower tiers")
        given: Sequence[object] = entries  # checked as objects: the compiled build too
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence):
            raise StorageError(
                "adopt_tier_entries: entries must be a sequence of (group, hash, tag) integer "
                f"tuples, got {brief_repr(given)}; nothing adopted"
            )
        for i, entry in enumerate(given):
            if not (
                isinstance(entry, tuple)
                and len(entry) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) for v in entry)
            ):
                raise StorageError(
                    f"adopt_tier_entries: entry {i} is {entry!r}, not (group, hash, tag) "
                    "integers; nothing adopted"
                )
        taken = tiers.adopt(tier, entries)
        self._coord.sessions.enforce()
        return taken

    def persist_to_tier(self, tier: str = "disk") -> None:
        """Copy everything cached (device blocks, upper-tier entries) into ``tier``: what a
        persistent disk tier needs before the process ends, so the next one finds it.  Only
        while no request holds blocks (raises :class:`RequestError` otherwise: a running
        request's blocks may not be written yet); the storage operations follow in
        :meth:`take_tier_ops`.  Raises :class:`PlanError` without such a tier."""
        tiers = self._coord.tiers
        if tiers is None:
            raise PlanError(f"tier {tier!r}: this manager has no lower tiers")
        if self._coord.requests:
            raise RequestError(
                f"persist_to_tier: {len(self._coord.requests)} requests still hold blocks; "
                "free them first"
            )
        tiers.named(tier)
        self._coord.persist(tier)
        self._coord.sessions.enforce()

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Per lower tier: capacity, bytes and blocks held, blocks stored, loaded (hits read
        back), dropped (evicted from it), discarded (unusable in storage) and adopted (from an
        earlier process); empty without tiers."""
        tiers = self._coord.tiers
        return {} if tiers is None else tiers.stats()
