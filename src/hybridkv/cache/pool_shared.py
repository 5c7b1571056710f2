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

from hybridkv.cache.events import EventLog
from hybridkv.cache.pool_base import BlockPool, FreeListPool, GroupLists
from hybridkv.errors import InvariantError
from hybridkv.plan.layout import MemoryLayout, Strategy

__all__ = ["PerGroupPools", "UniformPool"]


class UniformPool(BlockPool):
    """One :class:`FreeListPool` shared by every group of a ``uniform`` layout."""

    strategy: ClassVar[Strategy] = Strategy.UNIFORM

    def __init__(self, layout: MemoryLayout, events: EventLog) -> None:
        super().__init__(layout, events)
        if len(layout.pools) != 1:
            raise InvariantError(f"uniform layout with {len(layout.pools)} pools")
        pool = layout.pools[0]
        self.core = FreeListPool(pool.num_blocks, range(self.num_groups), events)
        self.block_bytes = pool.block_bytes
        self.refs = [self.core.refs] * self.num_groups
        self.hashes = [self.core.hashes] * self.num_groups
        self.maps = [self.core.maps[g] for g in range(self.num_groups)]

    def allocate(self, group_id: int, n: int) -> list[int]:
        return self.core.allocate(group_id, n)

    def touch(self, group_id: int, blocks: Sequence[int]) -> None:
        self.core.touch(blocks)

    def release(self, group_id: int, blocks: Sequence[int]) -> None:
        self.core.release(blocks)

    def refresh(self, group_id: int, blocks: Sequence[int]) -> None:
        self.core.refresh(blocks)

    def fits(
        self,
        cached: Sequence[set[int] | None],
        releases: GroupLists,
        touches: GroupLists,
        needs: Sequence[int],
    ) -> bool:
        core = self.core
        free = core.num_free
        for g in range(self.num_groups):
            if releases[g] or touches[g]:
                free += core.free_delta(releases[g], touches[g])
        return sum(needs) <= free

    def num_free(self, group_id: int) -> int:
        return self.core.num_free

    @property
    def usage(self) -> float:
        return self.core.num_used / (self.core.num_blocks - 1)

    def num_used(self, group_id: int) -> int:
        core = self.core
        return sum(1 for b, r in enumerate(core.refs) if r and core.owner[b] == group_id)

    def is_allocated(self, group_id: int, block_id: int) -> bool:
        core = self.core
        return super().is_allocated(group_id, block_id) and core.owner[block_id] == group_id

    def reset_cache(self) -> bool:
        return self.core.reset_cache()

    def check_invariants(self) -> None:
        self.core.check_invariants()

    def snapshot(self) -> Any:
        return self.core.snapshot()


class PerGroupPools(BlockPool):
    """One :class:`FreeListPool` per group of a ``pools`` layout."""

    strategy: ClassVar[Strategy] = Strategy.POOLS

    def __init__(self, layout: MemoryLayout, events: EventLog) -> None:
        super().__init__(layout, events)
        self.cores: list[FreeListPool] = []
        self.block_bytes: list[int] = []
        for g in range(self.num_groups):
            plan = layout.pool_of(g)
            self.cores.append(FreeListPool(plan.num_blocks, (g,), events))
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
        self.cores[group_id].touch(blocks)

    def release(self, group_id: int, blocks: Sequence[int]) -> None:
        self.cores[group_id].release(blocks)

    def refresh(self, group_id: int, blocks: Sequence[int]) -> None:
        self.cores[group_id].refresh(blocks)

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
        used = sum(c.num_used * bb for c, bb in zip(self.cores, self.block_bytes, strict=True))
        return used / self._total_bytes

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
