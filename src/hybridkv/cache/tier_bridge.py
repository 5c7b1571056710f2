"""Where the coordinator's groups meet the lower tiers (host, disk).

:class:`TierBridge` carries the per-group rules between the device managers and a
:class:`~hybridkv.cache.tiers.TierStack`: which tier a device eviction goes to (a state
checkpoint keeps its admission reason, and one the yield rule would not save now skips the host
tier), which lower-tier entries a hit reads and from where, how the fresh device blocks a load
fills are published, and what a queued request's hit keeps young.  The coordinator owns one
when it has tiers and calls it at eviction, lookup and first allocation.  Bookkeeping only.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.cache.admission import CheckpointAdmission
from hybridkv.cache.kinds import GroupState, KindManager
from hybridkv.cache.request import Request
from hybridkv.cache.tiers import TierStack
from hybridkv.cache.types import BlockHash, BlockId, TierLoad
from hybridkv.errors import PlanError

__all__ = ["LoadSpots", "TierBridge"]

#: Per group of a hit: ``(table index, hash)`` of each block read back, and its tier's name.
LoadSpots = tuple[list[tuple[int, int]], list[str]]


class TierBridge:
    """The lower tiers ``tiers`` under the device ``managers`` (one per group)."""

    def __init__(
        self,
        tiers: TierStack,
        managers: Sequence[KindManager],
        admission: CheckpointAdmission | None,
        tier_admission: str,
        write_through: str | None = None,
    ) -> None:
        self.tiers = tiers
        self.managers = list(managers)
        self.admission = admission
        self.tier_admission = tier_admission
        #: The tier every published block is also stored in once its step ran (None: blocks
        #: go down only when the device evicts them), and the publications not yet stored.
        self.write_through = write_through
        self.published: list[tuple[int, list[tuple[int, int, int]]]] = []
        #: The write-through tier's level in ``tiers`` (0 without write-through).
        self._through_level = 0
        if write_through is not None:
            names = [t.name for t in tiers.tiers]
            if write_through not in names:
                raise PlanError(
                    f"tier_write_through: {write_through!r} is not a tier of this cache; "
                    f"valid: {', '.join(names)}"
                )
            self._through_level = names.index(write_through)
            for m in self.managers:
                m.through = self.published

    def flush_through(self) -> int:
        """Store every block published since the last call in the write-through tier, in
        publication order, as a cold copy (:mod:`hybridkv.cache.tiers`: it takes only room
        that free bytes or other cold copies give, and warms when the device evicts the
        block); a checkpoint keeps its reason, and the ``yield`` rule routes checkpoints as
        at eviction.  Call once the steps that compute them ran: the stores copy the device
        blocks.  A block no longer cached under its hash (taken back, or evicted and so
        written back already) is skipped; one the tier already holds stays as it is.
        Returns how many blocks were offered."""
        pending, self.published[:] = list(self.published), []
        level = self._through_level
        offered = 0
        for g, items in pending:
            m = self.managers[g]
            held = m.map
            kept = [(h, b) for _, b, h in items if held.get(h) == b]
            if not kept:
                continue
            hashes = [h for h, _ in kept]
            blocks = [b for _, b in kept]
            offered += len(kept)
            if level == 0:
                self.evicted(g, hashes, blocks, cold=True)
            else:
                reasons = getattr(m, "reasons", None)
                tags = None if reasons is None else [reasons[b] for b in blocks]
                self.tiers.evicted(g, hashes, blocks, tags, level=level, cold=True)
        return offered

    def evicted(
        self, group_id: int, hashes: Sequence[int], blocks: Sequence[int], cold: bool = False
    ) -> None:
        """Device evictions go down a tier; a state checkpoint keeps its admission reason.
        ``cold``: write-through copies of blocks the device keeps (see
        :mod:`hybridkv.cache.tiers`), routed the same way.
        With ``tier_admission="yield"`` a checkpoint whose reason the admission would not save
        now skips the host tier (it competes there with blocks that pay as on the device): it
        goes to the disk tier when there is one, else nowhere.  A disk tier alone takes
        everything."""
        tiers = self.tiers
        reasons = getattr(self.managers[group_id], "reasons", None)
        if reasons is None:
            tiers.evicted(group_id, hashes, blocks, cold=cold)
            return
        tags = [reasons[b] for b in blocks]
        adm = self.admission
        if adm is None or self.tier_admission != "yield" or tiers.tiers[0].name != "host":
            tiers.evicted(group_id, hashes, blocks, tags, cold=cold)
            return
        host: tuple[list[int], list[int], list[int]] = ([], [], [])
        below: tuple[list[int], list[int], list[int]] = ([], [], [])
        protected = tiers.protected  # a client will read these: the host tier takes them
        for h, b, t in zip(hashes, blocks, tags, strict=True):
            dest = below if t and h not in protected and not adm.admits(t, h) else host
            dest[0].append(h)
            dest[1].append(b)
            dest[2].append(t)
        if below[0] and len(tiers.tiers) > 1:
            tiers.evicted(group_id, *below, level=1, cold=cold)
        tiers.evicted(group_id, *host, cold=cold)

    def persist(self, tier: str) -> None:
        """Copy every cached device block and upper-tier entry into ``tier`` (see
        :meth:`TierStack.persist`); the device keeps its copies."""
        device: list[tuple[int, int, int, int]] = []
        for m in self.managers:
            reasons = getattr(m, "reasons", None)
            for h, b in m.map.items():
                device.append((m.group_id, h, b, 0 if reasons is None else reasons[b]))
        self.tiers.persist(tier, device)

    def retain(self, request: Request, length: int, hit: Sequence[Sequence[int]]) -> int:
        """Refresh the lower-tier entries of ``request``'s hit of ``length`` tokens (``hit``:
        its blocks per group, lower-tier ones ``-1``); returns how many moved."""
        hashes = request.block_hashes
        moved = 0
        for m, blocks in zip(self.managers, hit, strict=True):
            if any(b < 0 for b in blocks):
                # the prefix's end first, so its start is evicted last (as the device frees)
                spots = m.tier_spots(hashes, length, blocks)
                moved += self.tiers.refresh(m.group_id, [h for _, h in reversed(spots)])
        return moved

    def tier_blocks(
        self, request: Request, hit: Sequence[Sequence[int]], length: int
    ) -> list[tuple[int, int, str]]:
        """``(group, hash, tier)`` of every block of a hit of ``length`` tokens (``hit``: its
        blocks, lower-tier ones marked ``-1``) that would be read back from a lower tier, and
        the top tier holding it.  Reads only."""
        if not length:
            return []
        hashes = request.block_hashes
        out: list[tuple[int, int, str]] = []
        for i, blocks in enumerate(hit):
            if any(b < 0 for b in blocks):
                for _, h in self.managers[i].tier_spots(hashes, length, blocks):
                    name = self.tiers.where(i, h)
                    if name is not None:
                        out.append((i, h, name))
        return out

    def credit_checkpoint(
        self, group_id: int, request: Request, length: int, blocks: Sequence[int]
    ) -> None:
        """A hit of ``length`` tokens read group ``group_id``'s checkpoint back from a tier:
        credit the admission reason it was saved for."""
        m = self.managers[group_id]
        found = m.tier_spots(request.block_hashes, length, blocks)
        if found and self.admission is not None and hasattr(m, "reasons"):
            tag = self.tiers.tag(group_id, found[0][1])
            self.admission.checkpoint_hit(tag, length)

    def load_spots(
        self,
        request: Request,
        hit: Sequence[Sequence[int]],
        markers: Sequence[int],
        length: int,
    ) -> list[LoadSpots]:
        """Per group, ``(table index, hash)`` of each tier block of the hit and the tier it is
        read from.  The entries are refreshed in their tiers and pinned there until the
        allocation has recorded its loads (the coordinator then clears the pins), so the
        evictions the allocation causes cannot drop them, however small the tier."""
        hashes = request.block_hashes
        out: list[LoadSpots] = []
        tiers = self.tiers
        for i, k in enumerate(markers):
            spots = self.managers[i].tier_spots(hashes, length, hit[i]) if k else []
            out.append((spots, [tiers.load_hash(i, h) for _, h in spots]))
            for _, h in spots:
                tiers.pin(i, h)
        return out

    def install_loads(
        self,
        request: Request,
        st: GroupState,
        group_id: int,
        spots: LoadSpots,
        blocks: Sequence[int],
        loads: list[TierLoad],
    ) -> None:
        """Put fresh device ``blocks`` where the hit's tier blocks go, publish them under
        their hashes at once (the runner loads them before the step reads them), and record
        the loads."""
        tiers = self.tiers
        m = self.managers[group_id]
        where, names = spots
        items = m.install_loaded(st, where, blocks)
        reasons = getattr(m, "reasons", None)
        if reasons is not None:  # a checkpoint keeps the reason it was saved for
            for _, b, h in items:
                reasons[b] = tiers.tag(group_id, h)
        m.publish_loaded(items, request)
        for (_, h), b, name in zip(where, blocks, names, strict=True):
            tiers.loaded(group_id, h, name, b)
            loads.append(TierLoad(group_id, BlockId(b), name, BlockHash(h)))
