"""A request's state across every group of a layout, and its invariants against the pool.

:class:`RequestState` is what the coordinator keeps per running request (one
:class:`~hybridkv.cache.kinds.base.GroupState` per group plus the token bounds of its last
allocation); :class:`HitResult` is the outcome of its hit lookup; :func:`check_requests`
checks every request's tables against the pool's reference counts (tests and debugging,
O(blocks held)).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from hybridkv.cache.kinds import GroupState, KindManager
from hybridkv.cache.pool_base import BlockPool
from hybridkv.cache.request import Request
from hybridkv.errors import InvariantError
from hybridkv.specs import CacheKind

__all__ = ["HitResult", "RequestState", "check_requests"]


class RequestState:
    """A request's per-group states plus the token bounds of its last allocation.

    ``num_slots``: token slots allocated (lookahead included); ``num_reserved``: token slots
    the prefix-closed groups hold (at least ``num_slots``: a reservation adds the rest of the
    prompt there, see :meth:`KVCacheManager.allocate_slots`); ``min_computed``: the computed
    length the last allocation started from (windowed kinds released below it); ``marks``:
    the request's hit and junction, whose windows and checkpoints are re-aged (with the
    computed end's) when it is freed; ``quiet`` / ``quiet_computed``: the bounds of every
    group's :meth:`~hybridkv.cache.kinds.base.KindManager.quiet_end` after the last
    allocation (a later one without hit or lookahead, whose step ends at or below ``quiet``
    from at most ``quiet_computed`` computed tokens, changes nothing but the two bounds
    above).
    """

    __slots__ = (
        "groups",
        "marks",
        "min_computed",
        "num_reserved",
        "num_slots",
        "quiet",
        "quiet_computed",
        "request",
    )

    def __init__(self, request: Request, groups: list[GroupState], marks: tuple[int, ...]) -> None:
        self.request = request
        self.groups = groups
        self.num_slots = self.num_reserved = 0
        self.min_computed = 0
        self.quiet = self.quiet_computed = 0
        #: Token positions where later requests are likely to hit (its hit and junction).
        self.marks = marks


class HitResult:
    """Outcome of the fixed point: hit length, per-group standalone hits, junction."""

    __slots__ = ("alone", "junction", "length")

    def __init__(self, length: int, alone: list[int], junction: int) -> None:
        self.length = length
        self.alone = alone
        self.junction = junction


def check_requests(
    requests: Iterable[RequestState], managers: Sequence[KindManager], pool: BlockPool
) -> None:
    """Raise :class:`InvariantError` unless each request's per-group state is valid, its
    tables are as long as its slots need, and every block's reference count equals the
    number of requests holding it."""
    expected: dict[int, list[int]] = {}
    for rs in requests:
        request = rs.request
        if rs.num_reserved < rs.num_slots:
            raise InvariantError(
                f"request {request.request_id}: {rs.num_reserved} reserved slots, fewer "
                f"than its {rs.num_slots} slots"
            )
        for m, st in zip(managers, rs.groups, strict=True):
            m.check_request(st, request)
            g = m.group_id
            refs = pool.refs[g]
            counts = expected.setdefault(id(refs), [0] * len(refs))
            for b in m.held_blocks(st):
                counts[b] += 1
                if not pool.is_allocated(g, b):
                    raise InvariantError(
                        f"request {request.request_id} holds block {b} of group {g}, "
                        "which the pool does not count as allocated to that group"
                    )
            if m.spec.kind is not CacheKind.STATE:
                slots = rs.num_reserved if m.prefix_closed else rs.num_slots
                want = -(-slots // m.block_size)
                if len(st.table) != want:
                    raise InvariantError(
                        f"request {request.request_id}, group {g}: table has "
                        f"{len(st.table)} entries for {slots} slots (want {want})"
                    )
    for g in range(len(managers)):
        refs = pool.refs[g]
        want_refs = expected.get(id(refs))
        if want_refs is None:
            if any(refs):
                raise InvariantError(f"group {g}: blocks referenced with no live request")
        elif want_refs != refs:
            bad = [b for b, (c, r) in enumerate(zip(want_refs, refs, strict=True)) if c != r]
            raise InvariantError(
                f"group {g}: ref counts differ from table references at blocks {bad[:10]}"
            )
