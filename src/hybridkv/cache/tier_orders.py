"""One lower tier's entries and eviction orders (:class:`Tier`), for
:class:`~hybridkv.cache.tiers.TierStack`.

An entry sits in exactly one order: *cold* (write-through copies of blocks the device still
caches, evicted first), *warm* (the recency order), *protected* (hashes a client session
protects, :mod:`hybridkv.cache.tier_sessions`: evicted last) or, while an allocation reads it
back, *held* out of every order.  Interpreted in every build, as :mod:`hybridkv.cache.tiers`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridkv.cache.tiers import TierSpec

__all__ = ["Tier"]


class Tier:
    """One tier's entries: per group ``hash -> None`` plus one LRU over all of them."""

    __slots__ = (
        "adopted",
        "block_bytes",
        "capacity_bytes",
        "cold",
        "cold_bytes",
        "device_bytes",
        "discarded",
        "dropped",
        "held",
        "keep_limit",
        "kept",
        "kept_bytes",
        "keys",
        "loaded",
        "loaded_bytes",
        "lru",
        "name",
        "protected",
        "stored",
        "stored_bytes",
        "used_bytes",
    )

    def __init__(
        self, spec: TierSpec, block_bytes: Sequence[int], protect_share: float = 1.0
    ) -> None:
        self.name = spec.name
        self.capacity_bytes = spec.capacity_bytes
        self.block_bytes = list(block_bytes)
        #: Per group ``hash -> tag`` (a state checkpoint's admission reason, else 0).
        self.keys: list[dict[int, int]] = [{} for _ in block_bytes]
        self.lru: OrderedDict[tuple[int, int], None] = OrderedDict()
        #: Cold entries (write-through copies of device-cached blocks), oldest first: evicted
        #: before any entry of :attr:`lru`; ``cold_bytes`` of the ``used_bytes`` are theirs.
        self.cold: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.cold_bytes = 0
        #: Warm entries whose hash is in ``protected`` (hash -> how many sessions protect
        #: it; shared by the stack's tiers), oldest first: evicted after every other entry.
        self.kept: OrderedDict[tuple[int, int], None] = OrderedDict()
        self.protected: dict[int, int] = {}
        #: Bytes of the protected entries (those in :attr:`kept` and those held out of it),
        #: and how many of them the tier keeps before a session ends
        #: (:meth:`~hybridkv.cache.tier_sessions.TierSessions.enforce`).
        self.kept_bytes = 0
        self.keep_limit = int(spec.capacity_bytes * protect_share)
        #: Entries an allocation under way reads back, taken out of their order (0: cold,
        #: 1: warm, 2: protected) so no eviction picks them and none walks past them; they
        #: return to its young end once the allocation recorded its loads.
        self.held: dict[tuple[int, int], int] = {}
        self.used_bytes = 0
        #: Blocks written into / loaded from / dropped by this tier, and bytes moved.
        self.stored = self.loaded = self.dropped = 0
        #: Entries found unusable by storage (a failed or corrupt copy) and taken out, and
        #: entries adopted from storage that outlived an earlier process.
        self.discarded = self.adopted = 0
        self.stored_bytes = self.loaded_bytes = 0
        #: Of ``stored_bytes``, those copied from the device (evictions, write-through), not
        #: moved down from a tier above.
        self.device_bytes = 0

    def __contains__(self, key: tuple[int, int]) -> bool:
        return key[1] in self.keys[key[0]]

    def __len__(self) -> int:
        return len(self.lru) + len(self.cold) + len(self.kept) + len(self.held)

    def entries(self) -> set[tuple[int, int]]:
        """Every ``(group, hash)`` the tier holds, warm, cold, protected and held."""
        return set(self.lru) | set(self.cold) | set(self.kept) | set(self.held)

    def bytes_under(self, hashes: Sequence[int], enough: int = 0) -> int:
        """Bytes this tier holds under ``hashes`` (every group), counted until they reach
        ``enough`` (0: all of them)."""
        total = 0
        for g, keys in enumerate(self.keys):
            size = self.block_bytes[g]
            for h in hashes:
                if h in keys:
                    total += size
                    if enough and total >= enough:
                        return total
        return total

    def order(self, key: tuple[int, int]) -> OrderedDict[tuple[int, int], None]:
        """The warm order a warm entry ``key`` belongs in (protected or not)."""
        return self.kept if key[1] in self.protected else self.lru

    def warm(self, key: tuple[int, int]) -> None:
        """Make ``key`` (held) the most recently used entry of its order, warming it if it
        is cold."""
        held = self.held.get(key)
        if held is not None:  # out of its order while an allocation reads it: warm it there
            if not held:
                self.cold_bytes -= self.block_bytes[key[0]]
                if key[1] in self.protected:
                    self.kept_bytes += self.block_bytes[key[0]]
            self.held[key] = 2 if key[1] in self.protected else 1
            return
        if self.cold.pop(key, 0) is None:  # the orders map keys to None: it was cold
            self.cold_bytes -= self.block_bytes[key[0]]
            self.enter(key)
        else:
            self.order(key).move_to_end(key)

    def enter(self, key: tuple[int, int]) -> None:
        """Put ``key`` (not in any order) at the young end of the warm order it belongs in."""
        if key[1] in self.protected:
            self.kept[key] = None
            self.kept_bytes += self.block_bytes[key[0]]
        else:
            self.lru[key] = None

    def reorder(self, key: tuple[int, int], protect: bool, young: bool = False) -> None:
        """``key`` (held by this tier) became protected (``protect``: to the young end of the
        protected order) or stopped being so (to the evict-first end of the warm order, or
        its young end with ``young``); a cold entry stays cold, a held one returns to its new
        order."""
        held = self.held.get(key)
        size = self.block_bytes[key[0]]
        if held:
            self.held[key] = 2 if protect else 1
            self.kept_bytes += (protect - (held == 2)) * size
        elif protect:
            if self.lru.pop(key, 0) is None:  # the orders map keys to None: it was warm
                self.kept[key] = None
                self.kept_bytes += size
        elif self.kept.pop(key, 0) is None:
            self.lru[key] = None
            if not young:
                self.lru.move_to_end(key, last=False)
            self.kept_bytes -= size

    def pop_oldest(self, order: OrderedDict[tuple[int, int], None]) -> tuple[int, int, int]:
        """Take the oldest entry of ``order`` (one of this tier's) out; returns its group,
        hash and tag."""
        key = order.popitem(last=False)[0]
        g, h = key
        size = self.block_bytes[g]
        self.used_bytes -= size
        if order is self.cold:
            self.cold_bytes -= size
        elif order is self.kept:
            self.kept_bytes -= size
        return g, h, self.keys[g].pop(h)

    def victim(self, protected: bool) -> OrderedDict[tuple[int, int], None] | None:
        """The order whose oldest entry goes next: cold, then warm, then (to make room for a
        ``protected`` entry only) protected; None: no entry may go (held ones never do)."""
        if self.cold:
            return self.cold
        if self.lru:
            return self.lru
        return self.kept if protected and self.kept else None

    def hold(self, key: tuple[int, int]) -> None:
        """Take ``key`` (held by this tier) out of its order until :meth:`release_held`."""
        if key in self.held:
            return
        if self.cold.pop(key, 0) is None:
            self.held[key] = 0
        elif self.lru.pop(key, 0) is None:
            self.held[key] = 1
        else:
            del self.kept[key]
            self.held[key] = 2

    def release_held(self) -> None:
        """Put the held entries back, at the young end of their orders."""
        orders = (self.cold, self.lru, self.kept)
        for key, which in self.held.items():
            orders[which][key] = None
        self.held.clear()

    def forget(self, key: tuple[int, int]) -> int:
        """Take ``key`` (held) out; returns its tag."""
        g, h = key
        size = self.block_bytes[g]
        held = self.held.pop(key, None)
        if held is not None:
            if not held:
                self.cold_bytes -= size
            elif held == 2:
                self.kept_bytes -= size
        elif self.cold.pop(key, 0) is None:  # it was cold
            self.cold_bytes -= size
        elif self.kept.pop(key, 0) is None:
            self.kept_bytes -= size
        else:
            del self.lru[key]
        self.used_bytes -= size
        return self.keys[g].pop(h)
