"""The ``uniform`` and ``pools`` strategies.

* ``uniform``: one pool of equal-size blocks for every group (vLLM's hybrid allocator).  Block
  ids are shared: a block belongs to one group at a time, and one LRU orders the cached blocks
  of all groups, so eviction is global.
* ``pools``: one pool per group (SGLang / TensorRT-LLM style static split).  Each group evicts
  only its own blocks; a group cannot use another's free memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from hybridkv.cache.errors import LayoutMismatchError
from hybridkv.cache.events import EventLog
from hybridkv.cache.pool_base import (
    DEFAULT_CHANCES,
    BlockPool,
    GroupLists,
    chance_caps,
)
from hybridkv.cache.pool_freelist import FreeListPool
from hybridkv.errors import InvariantError
from hybridkv.plan.layout import MemoryLayout, Strategy

__all__ = ["FlatArenaPool", "PerGroupPools", "UniformPool"]


def _check_caps(core: FreeListPool, caps: Sequence[int]) -> None:
    """No block holds more chances than its owner group's cap."""
    hit = core.hit
    if hit is None:
        return
    for b, owner in enumerate(core.owner):
        if owner >= 0 and hit[b] > caps[owner]:
            raise InvariantError(
                f"block {b} of group {owner} holds {hit[b]} chances, more than {caps[owner]}"
            )


def _untouched(core: FreeListPool, cap: int, blocks: Sequence[int]) -> list[int]:
    """:meth:`BlockPool.untouched` on a free-list core whose group holds at most ``cap``
    chances."""
    hit = core.hit
    if hit is None or not cap:
        return []
    return [b for b in blocks if not hit[b]]


class UniformPool(BlockPool):
    """One :class:`FreeListPool` shared by every group of a ``uniform`` layout."""

    strategy: ClassVar[Strategy] = Strategy.UNIFORM

    def __init__(
        self,
        layout: MemoryLayout,
        events: EventLog,
        *,
        second_chance: int = DEFAULT_CHANCES,
        chances: Sequence[int] | None = None,
        eviction: str = "lru",
    ) -> None:
        super().__init__(layout, events)
        if len(layout.pools) != 1:
            raise InvariantError(f"uniform layout with {len(layout.pools)} pools")
        pool = layout.pools[0]
        caps = chance_caps(self.num_groups, second_chance, chances)
        self._init_core(pool.num_blocks, pool.block_bytes, caps, eviction=eviction)

    def _init_core(
        self,
        num_blocks: int,
        block_bytes: int,
        caps: list[int],
        first: int = 1,
        eviction: str = "lru",
    ) -> None:
        #: ``caps[g]``: the chances a block of group ``g`` holds at most.
        self.caps = caps
        self.core = FreeListPool(
            num_blocks,
            range(self.num_groups),
            self.events,
            first=first,
            second_chance=max(caps, default=0),
            eviction=eviction,
        )
        self.block_bytes = block_bytes
        self.refs = [self.core.refs] * self.num_groups
        self.hashes = [self.core.hashes] * self.num_groups
        self.maps = [self.core.maps[g] for g in range(self.num_groups)]

    def allocate(self, group_id: int, n: int) -> list[int]:
        return self.core.allocate(group_id, n)

    def touch(self, group_id: int, blocks: Sequence[int]) -> None:
        self.core.touch(group_id, blocks, self.caps[group_id])

    def release(self, group_id: int, blocks: Sequence[int]) -> None:
        self.core.release(group_id, blocks)

    def refresh(self, group_id: int, blocks: Sequence[int]) -> None:
        self.core.refresh(blocks)

    def untouched(self, group_id: int, blocks: Sequence[int]) -> list[int]:
        return _untouched(self.core, self.caps[group_id], blocks)

    def uncache(self, group_id: int, blocks: Sequence[int]) -> int:
        owner = self.core.owner
        return self.core.uncache([b for b in blocks if owner[b] == group_id])

    def fits(
        self,
        cached: Sequence[set[int] | None],
        releases: GroupLists,
        touches: GroupLists,
        needs: Sequence[int],
    ) -> bool:
        core = self.core
        free = core.num_free
        need = sum(needs)
        if need <= free and not any(touches):  # releases only add free blocks
            return True
        for g in range(self.num_groups):
            if releases[g] or touches[g]:
                free += core.free_delta(releases[g], touches[g])
        return need <= free

    def num_free(self, group_id: int) -> int:
        return self.core.num_free

    @property
    def usage(self) -> float:
        return self.core.num_used / (self.core.num_blocks - 1)

    @property
    def used_bytes(self) -> int:
        return self.core.num_used * self.block_bytes

    def num_used(self, group_id: int) -> int:
        return self.core.group_used[group_id]

    def is_allocated(self, group_id: int, block_id: int) -> bool:
        core = self.core
        return super().is_allocated(group_id, block_id) and core.owner[block_id] == group_id

    def reset_cache(self) -> bool:
        return self.core.reset_cache()

    def check_invariants(self) -> None:
        self.core.check_invariants()
        _check_caps(self.core, self.caps)

    def snapshot(self) -> Any:
        return self.core.snapshot()


class FlatArenaPool(UniformPool):
    """An ``arena`` layout whose chunks need no bookkeeping of their own, run on the uniform
    pool's free lists: one global LRU over cached blocks, one queue operation per block.

    Two cases (:meth:`applies`): every group's block is the chunk (equal page sizes, e.g.
    gpt-oss-20b), where chunk ``c`` is block ``c`` of whichever group holds it and
    :class:`~hybridkv.cache.pool_arena.ArenaPool`'s default ``chunk_lru`` policy is exactly
    this LRU (same block ids); or one group (e.g. DeepSeek-V3's MLA), where every chunk is
    that group's, so chunks only decide which blocks are evicted together, and a per-block
    LRU (vLLM's and ``uniform``'s) evicts the least recently used data instead.  Chunk 0's ids
    below the null host's first (:func:`hybridkv.plan.layout.null_host`) are never handed out,
    as in the arena; with one group, the tail's ids (:func:`hybridkv.plan.layout.tail_host`)
    follow the last chunk's.
    """

    strategy: ClassVar[Strategy] = Strategy.ARENA

    @staticmethod
    def applies(layout: MemoryLayout) -> bool:
        arena = layout.arena
        if arena is None:
            return False
        chunk = arena.chunk_bytes
        if len(layout.groups) == 1:
            return chunk % layout.groups[0].block_bytes == 0
        return all(g.block_bytes == chunk for g in layout.groups)

    def __init__(
        self,
        layout: MemoryLayout,
        events: EventLog,
        *,
        second_chance: int = DEFAULT_CHANCES,
        chances: Sequence[int] | None = None,
        eviction: str = "lru",
    ) -> None:
        BlockPool.__init__(self, layout, events)
        arena = layout.arena
        if arena is None or not self.applies(layout):
            raise InvariantError(
                "FlatArenaPool needs an arena whose chunk is every group's block, or one group"
            )
        self.bpc = arena.chunk_bytes // layout.groups[0].block_bytes
        host = layout.null_host  # one group: chunk 0 lends it the ids past the null region
        first = self.bpc if host is None else host.first
        tail = layout.tail_host  # one group: the bytes past the last chunk are its ids too
        num_ids = arena.num_chunks * self.bpc if tail is None else tail.end
        caps = chance_caps(self.num_groups, second_chance, chances)
        self._init_core(num_ids, layout.groups[0].block_bytes, caps, first, eviction)
        self.num_chunks = arena.num_chunks + (tail is not None)
        self._usable = num_ids - first

    @property
    def usage(self) -> float:
        return self.core.num_used / self._usable

    def chunk_owner(self, chunk: int) -> int | None:
        if not 0 <= chunk < self.num_chunks:
            raise LayoutMismatchError(
                f"chunk_owner: chunk {chunk} is not a chunk of this arena; valid: "
                f"[0, {self.num_chunks})"
            )
        core, bpc = self.core, self.bpc
        for b in range(chunk * bpc, min((chunk + 1) * bpc, len(core.refs))):
            if core.refs[b] or core.hashes[b] is not None:
                return int(core.owner[b])
        return None


class PerGroupPools(BlockPool):
    """One :class:`FreeListPool` per group of a ``pools`` layout."""

    strategy: ClassVar[Strategy] = Strategy.POOLS

    def __init__(
        self,
        layout: MemoryLayout,
        events: EventLog,
        *,
        second_chance: int = DEFAULT_CHANCES,
        chances: Sequence[int] | None = None,
        eviction: str = "lru",
    ) -> None:
        super().__init__(layout, events)
        caps = chance_caps(self.num_groups, second_chance, chances)
        self.cores: list[FreeListPool] = []
        self.block_bytes: list[int] = []
        for g in range(self.num_groups):
            plan = layout.pool_of(g)
            self.cores.append(
                FreeListPool(
                    plan.num_blocks, (g,), events, second_chance=caps[g], eviction=eviction
                )
            )
            self.block_bytes.append(plan.block_bytes)
        self.refs = [c.refs for c in self.cores]
        self.hashes = [c.hashes for c in self.cores]
        self.maps = [c.maps[g] for g, c in enumerate(self.cores)]
        self._total_bytes = sum(
            (c.num_blocks - 1) * bb for c, bb in zip(self.cores, self.block_bytes, strict=True)
        )

    def allocate(self, group_id: int, n: int) -> list[int]:
        return self.cores[group_id].allocate(group_id, n)

    def touch(self, group_id: int, blocks: Sequence[int]) -> None:
        self.cores[group_id].touch(group_id, blocks)

    def release(self, group_id: int, blocks: Sequence[int]) -> None:
        self.cores[group_id].release(group_id, blocks)

    def refresh(self, group_id: int, blocks: Sequence[int]) -> None:
        self.cores[group_id].refresh(blocks)

    def untouched(self, group_id: int, blocks: Sequence[int]) -> list[int]:
        core = self.cores[group_id]
        return _untouched(core, core.chances, blocks)

    def uncache(self, group_id: int, blocks: Sequence[int]) -> int:
        return self.cores[group_id].uncache(blocks)

    def fits(
        self,
        cached: Sequence[set[int] | None],
        releases: GroupLists,
        touches: GroupLists,
        needs: Sequence[int],
    ) -> bool:
        for g, core in enumerate(self.cores):
            free = core.num_free
            if releases[g] or touches[g]:
                free += core.free_delta(releases[g], touches[g])
            if needs[g] > free:
                return False
        return True

    def num_free(self, group_id: int) -> int:
        return self.cores[group_id].num_free

    @property
    def usage(self) -> float:
        return self.used_bytes / self._total_bytes

    @property
    def used_bytes(self) -> int:
        return sum(c.num_used * bb for c, bb in zip(self.cores, self.block_bytes, strict=True))

    def num_used(self, group_id: int) -> int:
        return self.cores[group_id].num_used

    def reset_cache(self) -> bool:
        if any(c.num_used for c in self.cores):
            return False
        for c in self.cores:
            c.reset_cache()
        return True

    def check_invariants(self) -> None:
        for c in self.cores:
            c.check_invariants()

    def snapshot(self) -> Any:
        return [c.snapshot() for c in self.cores]
