"""Lower cache tiers (host memory, disk): where blocks the device evicts go, and come back from.

Bookkeeping only (no bytes, no torch): which ``(group, block hash)`` each tier holds, in what
eviction order, against a byte capacity.  The storage layer moves the bytes as the manager's
load and store instructions say.

* **Write-back on eviction.**  When the device pool evicts a cached block to reuse it, the
  block's hash goes to the first tier (its data still sits in the device block: the copy must
  be taken before the block's next write, which the runner orders).  A tier that is full
  evicts its least recently used entry into the next tier, and the last tier drops it.
* **Lookups** see the union: a group serves a position when its block is on the device or in
  any tier (:class:`TieredMap`), so the coordinator's fixed point is unchanged.
* **Loads.**  A hit on a tier block gets a fresh device block, published under the hash at
  once, and a :class:`TierLoad` in :attr:`~hybridkv.cache.types.AllocationResult.loads`; the
  runner must complete the copy before the step reads the block.  Tiers are inclusive: the
  entry stays where it was (refreshed), so evicting the device copy again writes nothing.
* **Write-through copies** (``cold=True``: the manager's ``tier_write_through``) of blocks
  the device still caches are *cold*: kept apart from the recency order and evicted before
  any other entry (the oldest first), dropped rather than moved down (the device holds the
  data), and stored only into room that cold entries or free bytes give, never in place of
  an entry a device eviction, a load or a move put there.  A cold entry warms (joins the
  recency order at its young end) when the device evicts its block, a hit reads it or an
  upper tier moves it down, so the warm entries are exactly those write-back would hold.
* **Protected entries** (:mod:`hybridkv.cache.tier_sessions`: a client says a request's
  prefix will be read again, e.g. a conversation that goes on): warm entries whose hash is
  protected sit in an order of their own, evicted only to make room for another protected
  entry once the tier holds no other; an entry that is not protected and finds only
  protected ones in its way goes down a tier instead (or is dropped).  Protected entries fill
  at most ``protect_share`` of a tier (:attr:`Tier.keep_limit`); the sessions enforce it.

Example: two tiers, one block of group 0 (1 KiB) evicted by the device::

    >>> stack = TierStack([TierSpec("host", 4096), TierSpec("disk", 1 << 20)], [1024])
    >>> stack.evicted(0, (7,), (3,))
    >>> stack.where(0, 7), stack.tiers[0].used_bytes
    ('host', 1024)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

from hybridkv.cache.events import EventLog
from hybridkv.cache.tier_orders import Tier
from hybridkv.cache.types import TierLoad
from hybridkv.errors import InvariantError, PlanError

__all__ = [
    "TIER_NAMES",
    "Tier",
    "TierLoad",
    "TierOp",
    "TierSpec",
    "TierStack",
    "TieredMap",
    "check_protect_share",
    "tier_hit_tokens",
]

#: Tier names, top (nearest the device) first.
TIER_NAMES = ("host", "disk")


@dataclass(frozen=True)
class TierSpec:
    """One lower tier: ``name`` (``host`` or ``disk``) and its capacity in bytes (> 0)."""

    name: str
    capacity_bytes: int

    def __post_init__(self) -> None:
        if self.name not in TIER_NAMES:
            raise PlanError(
                f"TierSpec.name: unknown tier {self.name!r}; valid: {', '.join(TIER_NAMES)}"
            )
        cap = self.capacity_bytes
        if not isinstance(cap, int) or isinstance(cap, bool) or cap <= 0:
            raise PlanError(
                f"TierSpec.capacity_bytes: the {self.name} tier needs a positive byte count, "
                f"got {cap!r}"
            )


def check_protect_share(value: object, field: str = "protect_share") -> float:
    """``value`` as a share of a tier protected sessions may fill: a number in (0, 1];
    raises :class:`PlanError` naming ``field`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise PlanError(
            f"{field}: the share of each lower tier protected sessions may fill must be "
            f"a number in (0, 1], got {value!r}"
        )
    return float(value)


class TierOp(NamedTuple):
    """One thing tier storage must do, in stream order.

    ``store``: copy device ``block`` of group ``group_id`` (holding ``block_hash``) into tier
    ``tier``; ``load``: copy tier ``tier``'s entry into device ``block``; ``move``: move the
    entry from ``tier`` to ``dest``; ``drop``: delete the entry from ``tier``; ``clear``:
    delete everything; ``relocate`` (tier ``"device"``): compaction moved device block
    ``from_block`` of the group to ``block`` (copy its bytes; ``block_hash`` is 0).  A store
    or load must run before the step that reuses or reads the device block, and every
    operation in this order relative to the others: a store of a block compaction then
    fills, or a load into a block it then moves, reads or writes the block's old place.
    """

    op: str
    tier: str
    group_id: int
    block_hash: int
    block: int
    dest: str = ""
    #: What the tier remembers of the entry (a state checkpoint's admission reason), for
    #: storage that outlives the process.
    tag: int = 0
    #: ``relocate``: the device block the bytes come from.
    from_block: int = -1


class TieredMap:
    """Group ``g``'s device ``hash -> block`` map seen through the lower tiers: a hash held
    only by a tier is present with block ``-1`` (a load marker)."""

    __slots__ = ("device", "lower")

    def __init__(self, device: dict[int, int], lower: list[dict[int, int]]) -> None:
        self.device = device
        self.lower = lower

    def __contains__(self, h: object) -> bool:
        if h in self.device:
            return True
        for keys in self.lower:  # noqa: SIM110 - a loop: no generator per lookup
            if h in keys:
                return True
        return False

    def flags(self, hashes: Sequence[int]) -> bytes:
        """``flags[i] == 1`` iff ``hashes[i]`` is on the device or in a tier: one C-speed pass
        per map, the passes OR-ed as integers (each byte is 0 or 1)."""
        out = bytes(map(self.device.__contains__, hashes))
        if 0 not in out:
            return out
        acc = int.from_bytes(out, "little")
        for keys in self.lower:
            acc |= int.from_bytes(bytes(map(keys.__contains__, hashes)), "little")
        return acc.to_bytes(len(out), "little")

    def blocks(self, hashes: Sequence[int]) -> list[int]:
        """The device block of each of ``hashes``, ``-1`` where only a tier holds it; raises
        :class:`KeyError` for a hash held nowhere (as ``[]`` does), so a stale hit is found
        before anything changes."""
        held = self.flags(hashes)
        if 0 in held:
            raise KeyError(hashes[held.index(0)])
        return list(map(self.device.get, hashes, repeat(-1, len(hashes))))

    def __getitem__(self, h: int) -> int:
        b = self.device.get(h)
        if b is not None:
            return b
        for keys in self.lower:
            if h in keys:
                return -1
        raise KeyError(h)

    def get(self, h: int, default: Any = None) -> Any:
        try:
            return self[h]
        except KeyError:
            return default


class TierStack:
    """The lower tiers of one cache, top first, over a layout's groups (``block_bytes[g]``:
    the bytes one block of group ``g`` takes in a tier)."""

    def __init__(
        self,
        specs: Sequence[TierSpec],
        block_bytes: Sequence[int],
        *,
        record_ops: bool = False,
        events: EventLog | None = None,
        block_sizes: Sequence[int] = (),
        protect_share: float = 1.0,
    ) -> None:
        names = [s.name for s in specs]
        if (
            not specs
            or len(set(names)) != len(names)
            or names != sorted(names, key=TIER_NAMES.index)
        ):
            raise PlanError(
                f"tiers: {names} must be distinct tiers in order {', '.join(TIER_NAMES)}"
            )
        smallest = min(block_bytes, default=0)
        for s in specs:
            if s.capacity_bytes < smallest:
                raise PlanError(
                    f"{s.name}_memory_bytes: a {s.name} tier of {s.capacity_bytes} B holds no "
                    f"block; the smallest block here is {smallest} B"
                )
        share = check_protect_share(protect_share)
        self.tiers = [Tier(s, block_bytes, share) for s in specs]
        #: Protected hashes (:mod:`hybridkv.cache.tier_sessions`), shared by every tier.
        self.protected: dict[int, int] = {}
        for t in self.tiers:
            t.protected = self.protected
        self.num_groups = len(block_bytes)
        #: With ``record_ops``: what storage must do, in order (:meth:`take_ops`).
        self.record_ops = record_ops
        self.ops: list[TierOp] = []
        #: KV events naming the tier, when the log is enabled (``block_sizes``: tokens).
        self.events = events if events is not None and events.enabled else None
        self.block_sizes = list(block_sizes) or [0] * len(block_bytes)

    def over_limit(self) -> bool:
        """Whether some tier keeps more protected bytes than its share allows."""
        return any(t.kept_bytes > t.keep_limit for t in self.tiers)

    def view(self, group_id: int, device: dict[int, int]) -> TieredMap:
        """Group ``group_id``'s lookup map over ``device`` and every tier."""
        return TieredMap(device, [t.keys[group_id] for t in self.tiers])

    def where(self, group_id: int, h: int) -> str | None:
        """The top tier holding hash ``h`` of group ``group_id`` (None: no tier)."""
        for t in self.tiers:
            if h in t.keys[group_id]:
                return t.name
        return None

    # -- mutation -----------------------------------------------------------------------------
    def evicted(
        self,
        group_id: int,
        hashes: Sequence[int],
        blocks: Sequence[int],
        tags: Sequence[int] | None = None,
        level: int = 0,
        cold: bool = False,
    ) -> None:
        """The device evicted these blocks of ``group_id`` (``blocks[i]`` still holds
        ``hashes[i]``; ``tags[i]``: what to remember of it, e.g. a checkpoint's admission
        reason): write them back to the top tier (or to tier ``level``).  ``cold``: they are
        write-through copies of blocks the device keeps (see the module docstring)."""
        for i, (h, b) in enumerate(zip(hashes, blocks, strict=True)):
            self._put(level, group_id, h, b, None, tags[i] if tags is not None else 0, cold)

    def tag(self, group_id: int, h: int) -> int:
        """The tag stored with hash ``h`` of ``group_id`` (0 when no tier holds it)."""
        for t in self.tiers:
            found = t.keys[group_id].get(h)
            if found is not None:
                return found
        return 0

    def _put(
        self,
        level: int,
        g: int,
        h: int,
        block: int,
        source: str | None,
        tag: int,
        cold: bool = False,
    ) -> None:
        """Enter ``(g, h)`` into tier ``level``, from device ``block`` (``source`` None) or
        from tier ``source``; ``cold``: a write-through copy (see the module docstring)."""
        t = self.tiers[level]
        key = (g, h)
        if h in t.keys[g]:
            if not cold:
                t.warm(key)
            if source is not None and self.record_ops:
                self.ops.append(TierOp("drop", source, g, h, 0))  # the copy here is the same
            return
        size = t.block_bytes[g]
        if cold and t.used_bytes - t.cold_bytes + size > t.capacity_bytes:
            return  # only free room or other cold copies make way for a cold copy
        while t.used_bytes + size > t.capacity_bytes:
            order = None if size > t.capacity_bytes else t.victim(h in self.protected)
            if order is None:  # it cannot fit here (too large, protected or being read)
                if level + 1 < len(self.tiers):
                    self._put(level + 1, g, h, block, source, tag)
                elif source is not None and self.record_ops:
                    self.ops.append(TierOp("drop", source, g, h, 0))
                return
            was_cold = order is t.cold
            og, oh, otag = t.pop_oldest(order)
            t.dropped += 1
            if self.events is not None:
                self.events.tier_removed(og, oh, t.name)
            if level + 1 < len(self.tiers) and not was_cold:
                self._put(level + 1, og, oh, 0, t.name, otag)
            elif self.record_ops:
                self.ops.append(TierOp("drop", t.name, og, oh, 0))
        if cold:
            t.cold[key] = None
            t.cold_bytes += size
        else:
            t.enter(key)
        t.keys[g][h] = tag
        t.used_bytes += size
        t.stored += 1
        t.stored_bytes += size
        if source is None:
            t.device_bytes += size
        if self.events is not None:
            self.events.tier_stored(g, h, t.name, self.block_sizes[g])
        if self.record_ops:
            if source is None:
                self.ops.append(TierOp("store", t.name, g, h, block, "", tag))
            else:
                self.ops.append(TierOp("move", source, g, h, 0, t.name, tag))

    def pin(self, group_id: int, h: int) -> None:
        """An allocation under way reads hash ``h`` of ``group_id`` back (its loads are
        recorded after its evictions): hold the entry it reads (the top tier's) out of the
        eviction orders, so those evictions cannot drop it, until :meth:`unpin`.  Copies in
        the tiers below stay evictable: nothing reads them, and held they would take room a
        write-back cache would have (a disk tier's cold write-through copies)."""
        for t in self.tiers:
            if h in t.keys[group_id]:
                t.hold((group_id, h))
                return

    def unpin(self) -> None:
        """The allocation recorded its loads: every held entry returns to its order."""
        for t in self.tiers:
            if t.held:
                t.release_held()

    def loaded(self, group_id: int, h: int, tier: str, block: int) -> None:
        """Record that device ``block`` is to be filled from ``tier``'s copy of ``h``."""
        if self.record_ops:
            self.ops.append(TierOp("load", tier, group_id, h, block))

    def relocated(self, moves: Sequence[tuple[int, int, int]]) -> None:
        """Compaction moved device blocks ``(group, src, dst)``, in this order: record a
        ``relocate`` for each (the entries of the tiers do not change)."""
        if self.record_ops:
            self.ops.extend(TierOp("relocate", "device", g, 0, d, "", 0, s) for g, s, d in moves)

    def persist(self, name: str, device: Sequence[tuple[int, int, int, int]]) -> None:
        """Copy everything cached into tier ``name`` (a disk tier before the process ends):
        the entries of the tiers above it (moved down, oldest first), then the device's cached
        blocks ``(group, hash, block, tag)`` (stored).  Entries already there are refreshed;
        the tier's own eviction order decides what fits."""
        level = next((i for i, t in enumerate(self.tiers) if t.name == name), None)
        if level is None:
            self.named(name)  # raises
            return
        for upper in self.tiers[:level]:
            for key in [*upper.cold, *upper.lru, *upper.kept]:  # in eviction order
                g, h = key
                tag = upper.forget(key)
                if self.events is not None:
                    self.events.tier_removed(g, h, upper.name)
                self._put(level, g, h, 0, upper.name, tag)
        for g, h, block, tag in device:
            self._put(level, g, h, block, None, tag)

    def discard(self, group_id: int, h: int) -> bool:
        """Storage found the entry ``(group_id, h)`` unusable (a failed write, a truncated or
        corrupt copy): take it out of every tier holding it, so lookups miss it.  Records a
        ``drop`` for each tier.  Returns whether any tier held it."""
        found = False
        for t in self.tiers:
            if h in t.keys[group_id]:
                found = True
                self._remove(t, group_id, h)
                t.discarded += 1
        return found

    def _remove(self, t: Tier, group_id: int, h: int) -> None:
        """Take the held entry ``(group_id, h)`` out of tier ``t``: an event, a ``drop``."""
        t.forget((group_id, h))
        if self.events is not None:
            self.events.tier_removed(group_id, h, t.name)
        if self.record_ops:
            self.ops.append(TierOp("drop", t.name, group_id, h, 0))

    def drop_copy(self, name: str, group_id: int, h: int) -> bool:
        """Storage of tier ``name`` cannot keep its copy of ``(group_id, h)`` (no room where it
        keeps its bytes): take it out of that tier only, as an eviction would (counted as
        dropped; a copy in another tier stays).  Records a ``drop``.  Returns whether the tier
        held it."""
        t = self.named(name)
        if h not in t.keys[group_id]:
            return False
        self._remove(t, group_id, h)
        t.dropped += 1
        return True

    def adopt(self, name: str, entries: Sequence[tuple[int, int, int]]) -> list[int]:
        """Enter ``(group, hash, tag)`` entries that storage of tier ``name`` already holds
        (left by an earlier process), oldest first, without storage operations.  Entries
        that find no room, repeat a held hash or name an unknown group are skipped; returns
        the indices of the adopted ones (storage frees the rest)."""
        t = self.named(name)
        taken: list[int] = []
        for i, (g, h, tag) in enumerate(entries):
            if not 0 <= g < self.num_groups or h in t.keys[g]:
                continue
            size = t.block_bytes[g]
            if t.used_bytes + size > t.capacity_bytes:
                continue
            t.keys[g][h] = tag
            t.enter((g, h))
            t.used_bytes += size
            t.adopted += 1
            taken.append(i)
            if self.events is not None:
                self.events.tier_stored(g, h, t.name, self.block_sizes[g])
        return taken

    def named(self, name: str) -> Tier:
        """The tier called ``name``; raises :class:`PlanError` when there is none."""
        for t in self.tiers:
            if t.name == name:
                return t
        raise PlanError(
            f"tiers: no {name!r} tier here (tiers: {', '.join(t.name for t in self.tiers)})"
        )

    def take_ops(self) -> list[TierOp]:
        """The storage operations since the last call, in the order they must run."""
        ops, self.ops = self.ops, []
        return ops

    def refresh(self, group_id: int, hashes: Sequence[int]) -> int:
        """Move each entry of ``hashes`` (group ``group_id``) to the young end of the top tier
        holding it, in the order given (the last is evicted last); hashes no tier holds are
        skipped.  Moves no bytes.  Returns how many entries moved."""
        moved = 0
        for h in hashes:
            for t in self.tiers:
                if h in t.keys[group_id]:
                    t.warm((group_id, h))
                    moved += 1
                    break
        return moved

    def load_hash(self, group_id: int, h: int) -> str:
        """A hit reads hash ``h`` of ``group_id`` back: refresh its entry (most recently
        used) and return the name of the tier it is read from."""
        for t in self.tiers:
            if h in t.keys[group_id]:
                t.warm((group_id, h))
                t.loaded += 1
                t.loaded_bytes += t.block_bytes[group_id]
                return t.name
        raise InvariantError(f"tiers: group {group_id} hash {h:#x} is in no tier")

    def clear(self) -> None:
        """Forget every entry (a prefix-cache reset)."""
        if self.record_ops:
            self.ops.append(TierOp("clear", "", 0, 0, 0))
        for t in self.tiers:
            for keys in t.keys:
                keys.clear()
            t.lru.clear()
            t.cold.clear()
            t.kept.clear()
            t.used_bytes = t.cold_bytes = t.kept_bytes = 0

    # -- reporting ----------------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: capacity, bytes and blocks held, blocks stored, loaded, dropped, discarded
        (unusable in storage) and adopted (from an earlier process), and the bytes stored
        (``from_device_bytes`` of them copied from the device, the rest moved down from a tier
        above) and loaded; ``cold_blocks`` of the blocks are write-through copies no eviction
        or hit has warmed."""
        return {
            t.name: {
                "capacity_bytes": t.capacity_bytes,
                "used_bytes": t.used_bytes,
                "blocks": len(t),
                "cold_blocks": len(t.cold),
                "protected_blocks": len(t.kept),
                "protected_bytes": t.kept_bytes,
                "stored": t.stored,
                "loaded": t.loaded,
                "dropped": t.dropped,
                "discarded": t.discarded,
                "adopted": t.adopted,
                "stored_bytes": t.stored_bytes,
                "from_device_bytes": t.device_bytes,
                "loaded_bytes": t.loaded_bytes,
            }
            for t in self.tiers
        }

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` when a tier's keys, LRU and byte count disagree."""
        held = sum(len(t.held) for t in self.tiers)
        if held:
            raise InvariantError(f"tiers: {held} entries pinned between allocations")
        for t in self.tiers:
            keys = {(g, h) for g, d in enumerate(t.keys) for h in d}
            lru, cold_keys, kept = set(t.lru), set(t.cold), set(t.kept)
            if (
                keys != lru | cold_keys | kept
                or len(keys) != len(lru) + len(cold_keys) + len(kept)
                or any(h in t.protected for _, h in lru)
                or any(h not in t.protected for _, h in kept)
            ):
                raise InvariantError(
                    f"tiers: {t.name} keys and its warm, cold and protected orders differ"
                )
            cold = sum(t.block_bytes[g] for g, _ in t.cold)
            kept_bytes = sum(t.block_bytes[g] for g, _ in t.kept)
            used = cold + kept_bytes + sum(t.block_bytes[g] for g, _ in t.lru)
            if used != t.used_bytes or cold != t.cold_bytes or kept_bytes != t.kept_bytes:
                raise InvariantError(
                    f"tiers: {t.name} counts {t.used_bytes} B ({t.cold_bytes} cold, "
                    f"{t.kept_bytes} protected), holds {used} B ({cold} cold, {kept_bytes} "
                    "protected)"
                )
            if kept_bytes > t.keep_limit:
                raise InvariantError(
                    f"tiers: {t.name} keeps {kept_bytes} B of protected entries, over its "
                    f"limit of {t.keep_limit} B"
                )
            if used > t.capacity_bytes:
                raise InvariantError(
                    f"tiers: {t.name} holds {used} B over its capacity {t.capacity_bytes} B"
                )

    def snapshot(self) -> Any:
        """A comparable copy of every tier's entries in eviction order."""
        return tuple((t.name, (*t.cold, *t.lru, *t.kept), t.used_bytes) for t in self.tiers)


def tier_hit_tokens(loads: Sequence[TierLoad], block_sizes: Sequence[int]) -> dict[str, int]:
    """Prompt tokens one admission's hit read back per tier, from its ``loads``
    (``block_sizes[g]``: tokens per block of group ``g``): counted through the group that
    loaded the most tokens, since every group serves the same hit."""
    per_group: dict[int, dict[str, int]] = {}
    for load in loads:
        counts = per_group.setdefault(load.group_id, dict.fromkeys(TIER_NAMES, 0))
        counts[load.tier] += block_sizes[load.group_id]
    if not per_group:
        return dict.fromkeys(TIER_NAMES, 0)
    return max(per_group.values(), key=lambda c: sum(c.values()))
