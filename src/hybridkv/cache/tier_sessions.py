"""Protected sessions: prefixes a client says will be read again, kept in the lower tiers.

A recency order keeps what was used last, and on a conversation trace most of that never
comes back: a conversation ends after its last turn, and nothing in a request tells which
turn is the last (docs/tiers.md, "How large a host tier must be").  The client often
knows (a chat session still open, an agent loop that will call again), so it can say so:
:meth:`~hybridkv.cache.manager.KVCacheManager.protect` names a *session* and the request
whose cached prefix it will read again.  Every lower-tier entry (host, disk) under one of
that prefix's block hashes moves to the tier's protected order, evicted only once the tier
holds nothing else; entries that reach a tier later (the device evicts them after the call)
go there too.  Protecting a session again replaces its prefix (a conversation's next turn
contains the last one: the hashes they share stay protected);
:meth:`~hybridkv.cache.manager.KVCacheManager.unprotect` ends it, and its entries go to the
evict-first end of their tier (nobody will read them).  A hash several sessions protect (a
shared system prompt) stays protected until the last of them lets go.

Protection is bounded: protected entries may fill at most a share of each tier
(``protect_share``, default :data:`DEFAULT_PROTECT_SHARE`), so a client that never lets go
cannot turn the tiers into its own store.  Once a tier keeps more, sessions end until every
tier is within its share: the one just protected if it alone is over, else the least
recently protected one whose ending frees bytes there (:meth:`TierSessions.enforce`;
:attr:`TierSessions.expired` counts them).  The same happens while the sessions protect
more distinct block hashes than the device and those shares could hold (:func:`hash_limit`),
so sessions a client never ends cannot grow the bookkeeping without bound once their
entries have left the tiers.  Unlike ``unprotect`` (the client says nobody will read them),
an ended session's entries join the young end of their tier's recency order, its prefix's
start youngest: they are still likely to be read, and compete as what was just used.

The device's own eviction order is unchanged: a protected block the device evicts is written
back to the host tier as any other, and its protection starts there.  Without lower tiers a
session is recorded and changes nothing.  Bookkeeping only.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.cache.tiers import TierStack
from hybridkv.errors import InvariantError

__all__ = ["DEFAULT_PROTECT_SHARE", "TierSessions", "hash_limit"]

#: The share of each lower tier protected entries may fill by default (``protect_share``).
DEFAULT_PROTECT_SHARE = 0.9


def hash_limit(tiers: TierStack | None, device_bytes: int, bytes_per_hash: int) -> int | None:
    """How many distinct hashes sessions may protect: as many as the device (``device_bytes``)
    and the tiers' protected shares could hold at ``bytes_per_hash`` (the prefix-closed
    groups' bytes per block hash; a hash is protected while its blocks are still on the
    device, too).  None (no bound) without tiers or prefix-closed groups."""
    if tiers is None or bytes_per_hash <= 0:
        return None
    return (device_bytes + sum(t.keep_limit for t in tiers.tiers)) // bytes_per_hash


class TierSessions:
    """Named protected prefixes over the tiers ``tiers`` (None: no lower tier)."""

    def __init__(self, tiers: TierStack | None, hash_limit: int | None = None) -> None:
        self.tiers = tiers
        #: Distinct protected hashes at most (None: no bound but the tiers' bytes).
        self.hash_limit = hash_limit
        #: Session name -> the block hashes it protects.
        self.sessions: dict[str, list[int]] = {}
        #: Hash -> how many sessions protect it (the tiers' ``protected``, or a dict of ours).
        self.counts: dict[int, int] = {} if tiers is None else tiers.protected
        #: Sessions ended by :meth:`enforce` (a tier over its protected share, or more
        #: protected hashes than ``hash_limit``).
        self.expired = 0

    def protect(self, name: str, hashes: Sequence[int]) -> None:
        """Protect ``hashes`` under ``name``, replacing what ``name`` protected before."""
        new = list(dict.fromkeys(hashes))  # once each, in order
        old = self.sessions.pop(name, None)
        counts = self.counts
        for h in new:
            c = counts.get(h, 0)
            counts[h] = c + 1
            if not c:
                self._move(h, protect=True)
        self.sessions[name] = new
        if old is not None:
            self._let_go(old)

    def unprotect(self, name: str) -> bool:
        """End session ``name``; returns whether there was one."""
        old = self.sessions.pop(name, None)
        if old is None:
            return False
        self._let_go(old)
        return True

    def enforce(self, newest: str | None = None) -> int:
        """While a tier keeps more protected bytes than its share, or the sessions protect
        more than ``hash_limit`` hashes (see module), end a session: ``newest`` (the one just
        protected) first if it alone is over a limit, else the least recently protected one
        whose ending frees something where a limit is exceeded (sessions that do not are
        left alone).  Returns how many ended."""
        tiers = self.tiers
        if tiers is None or not self._over():
            return 0
        ended = 0
        sessions = self.sessions
        if newest is not None and newest in sessions and self._alone_over(sessions[newest]):
            self._end(newest)
            ended += 1
        while sessions and self._over():
            self._end(self._victim())
            ended += 1
        self.expired += ended
        return ended

    def _end(self, name: str) -> None:
        # its prefix's start joins the young end last (the youngest): see module
        self._let_go(self.sessions.pop(name)[::-1], young=True)

    def _over(self) -> bool:
        assert self.tiers is not None
        limit = self.hash_limit
        return (limit is not None and len(self.counts) > limit) or self.tiers.over_limit()

    def _alone_over(self, hashes: list[int]) -> bool:
        """Whether ``hashes`` alone are over the hash limit, or fill more than the share of a
        tier that is over it."""
        assert self.tiers is not None
        if self.hash_limit is not None and len(hashes) > self.hash_limit:
            return True
        for t in self.tiers.tiers:
            if t.kept_bytes > t.keep_limit and t.bytes_under(hashes) > t.keep_limit:
                return True
        return False

    def _victim(self) -> str:
        """The least recently protected session whose ending frees a protected hash (when
        over the hash limit) or bytes in a tier over its share (protect() re-inserts a
        session, so the sessions are oldest first); the oldest when none does."""
        assert self.tiers is not None
        counts = self.counts
        hashes_over = self.hash_limit is not None and len(counts) > self.hash_limit
        over = [t for t in self.tiers.tiers if t.kept_bytes > t.keep_limit]
        for name, hashes in self.sessions.items():
            sole = [h for h in hashes if counts[h] == 1]
            if sole and (hashes_over or any(t.bytes_under(sole, 1) for t in over)):
                return name
        return next(iter(self.sessions))

    def _let_go(self, hashes: list[int], young: bool = False) -> None:
        counts = self.counts
        for h in hashes:
            c = counts[h] - 1
            if c:
                counts[h] = c
            else:
                del counts[h]
                self._move(h, protect=False, young=young)

    def _move(self, h: int, protect: bool, young: bool = False) -> None:
        """Move every tier entry under hash ``h`` (of any group) into the protected order
        (``protect``) or out of it, to the evict-first end of the warm order (its young end
        with ``young``); cold entries stay cold (they are copies the device still holds)."""
        if self.tiers is None:
            return
        for t in self.tiers.tiers:
            for g, keys in enumerate(t.keys):
                if h in keys:
                    t.reorder((g, h), protect, young)

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` unless the protect counts are exactly the sessions'
        hashes counted (the tiers check their orders against the counts)."""
        expected: dict[int, int] = {}
        for hashes in self.sessions.values():
            if len(set(hashes)) != len(hashes):
                raise InvariantError("tier sessions: a session lists a hash twice")
            for h in hashes:
                expected[h] = expected.get(h, 0) + 1
        limit = self.hash_limit
        if limit is not None and len(self.counts) > limit:
            raise InvariantError(
                f"tier sessions: {len(self.counts)} protected hashes, over the limit of {limit}"
            )
        if expected != self.counts:
            raise InvariantError(
                f"tier sessions: {len(self.counts)} protected hashes counted, the "
                f"{len(self.sessions)} sessions hold {len(expected)}"
            )
