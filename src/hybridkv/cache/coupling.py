"""The parts of a state checkpoint leave the prefix cache together.

A layout with several recurrent-state groups (a state group cut by ``state_split``, or
state kinds with different specs) stores one checkpoint as one slot per group, each cached
under the same hash: the hash of the block ending at the checkpoint.  A hit restores it only
when every group serves that position (the coordinator's fixed point), so once a pool evicts
one part, the others can never serve a hit; left cached, they would hold memory until their
own turn in the eviction order, pushing out data that can.  With ``state_split=4`` on the
Mooncake trace that cost most of the split's gain (docs/architecture.md, section 5).

:class:`CheckpointCoupling` asks the event log to note the hashes every eviction of a state
group removes (:meth:`~hybridkv.cache.events.EventLog.couple`), and after each allocation
drops the other groups' parts still cached under them (:meth:`BlockPool.uncache`: they
become free uncached blocks, used before any cached block is evicted, and are reported as
evicted, so events and the lower tiers see the whole checkpoint go).  An allocation's
feasibility (``fits``) is decided before and does not count on this: the sweep only adds free
blocks.

Under ``checkpoint_life="kv"`` (``"auto"``, the default, without lower tiers) a checkpoint is
also coupled to the KV it ends: the prefix-closed groups' evictions are noted too, so once
the block ending at a checkpoint (cached under the same hash) leaves the device, the
checkpoint's parts are dropped with it.
A hit reaches a checkpoint only through every prefix-closed block before it, and blocks
leave roughly tail first, so from then on the checkpoint holds memory that serves nothing
(with lower tiers it goes down a tier with that block).  Measured on the Mooncake loop
(docs/vllm.md, section 6, "Checkpoints that live as their KV").

Every part of a checkpoint enters the cache in the same call (each group plans and
publishes a checkpoint at the same aligned step end) and is referenced by the same hits, so
the coupled groups' maps hold the same hashes after every call: :meth:`check` asserts it.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.cache.events import EventLog
from hybridkv.cache.kinds import KindManager
from hybridkv.cache.pool_base import BlockPool
from hybridkv.errors import InvariantError
from hybridkv.specs import CacheKind

__all__ = ["CheckpointCoupling"]


class CheckpointCoupling:
    """Drops a state checkpoint's remaining parts once one part, or (``with_kv``) the
    prefix-closed block it ends, is evicted (see module)."""

    __slots__ = ("events", "groups", "maps", "pool")

    def __init__(
        self,
        managers: Sequence[KindManager],
        pool: BlockPool,
        events: EventLog,
        with_kv: bool = False,
    ) -> None:
        self.pool = pool
        self.events = events
        #: The state groups (coupled when there are two or more, or, ``with_kv``, one or more
        #: and a prefix-closed group to couple them to).
        self.groups = [m.group_id for m in managers if m.spec.kind is CacheKind.STATE]
        kv = [m.group_id for m in managers if m.prefix_closed] if with_kv else []
        if len(self.groups) < 2 and not (self.groups and kv):
            self.groups = []
        self.maps = [pool.maps[g] for g in self.groups]
        if self.groups:
            events.couple([*self.groups, *kv])

    @property
    def active(self) -> bool:
        """Whether any eviction can leave checkpoint parts to drop."""
        return bool(self.groups)

    def sweep(self) -> int:
        """Drop every state group's free cached part under a hash the log noted as evicted
        since the last sweep (from a state group or a coupled prefix-closed one); returns how
        many parts were dropped."""
        orphaned = self.events.orphaned
        dropped = 0
        while orphaned:  # drops are evictions too: their notes come back, and find nothing
            hashes = list(orphaned)
            del orphaned[:]
            for g, m in zip(self.groups, self.maps, strict=True):
                blocks = [b for b in map(m.get, hashes) if b is not None]
                if blocks:
                    dropped += self.pool.uncache(g, blocks)
        return dropped

    def check(self) -> None:
        """Raise :class:`InvariantError` unless every coupled group caches the same hashes
        and nothing noted is left unswept."""
        if self.events.orphaned:
            raise InvariantError(
                f"{len(self.events.orphaned)} evicted checkpoint hashes were never swept"
            )
        if not self.groups:
            return
        first = self.maps[0].keys()
        for g, m in zip(self.groups[1:], self.maps[1:], strict=True):
            if m.keys() != first:
                extra = sorted(m.keys() - first)[:3]
                missing = sorted(first - m.keys())[:3]
                raise InvariantError(
                    f"state group {g} caches checkpoint parts that group {self.groups[0]} "
                    f"lacks ({[hex(h) for h in extra]}) or lacks some it holds "
                    f"({[hex(h) for h in missing]})"
                )
