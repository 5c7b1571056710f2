"""Dead tails: a freed request's attention blocks that no hit can read leave the cache at once.

In a layout whose hits are bounded by groups that are not prefix-closed (state checkpoints,
sliding windows), a hit ends where every group serves it: a state model's hit ends at a
cached checkpoint.  A full-attention block past the furthest position any hit along the
request's tokens could reach serves nothing: a later request with that prefix restarts from
the checkpoint before it and recomputes those positions anyway.  Under LRU such blocks still
take their turn in the eviction order, pushing out data that can serve hits: on the Mooncake
trace at 16 GiB (2,000 requests, ``benchmarks/compare_vllm.py``'s loop) Jamba-v0.1's freed
requests left about 1.3 million of them, most of every request's own attention blocks,
because the checkpoint admission saves few of their checkpoints.

At a request's free (or preemption), :class:`DeadTails` looks the request's tokens up
again, up to its computed end (the hit a longer request with this prefix would find: the
coordinator's fixed point, with every tier), and uncaches its prefix-closed blocks past that
hit: they become free uncached blocks, reused before any cached block is evicted, and are
reported as evicted (events, the lower tiers).  Only blocks no other request has read since
this one took them are dropped (the pool's
:meth:`~hybridkv.cache.pool_base.BlockPool.untouched`): a block another request hit may lie
on that request's own path to a checkpoint further along.  Blocks still referenced are
skipped (their other holders decide at their own free).

What it costs: a later request that shares the dropped prefix no longer shows where it
branched (its junction, where the checkpoint admission saves its most valuable
checkpoints).  With a host tier, dropping the prompt's blocks past the last checkpoint cost
hits in the simulator (dropping only those past the prompt did not; why is not settled), so
``"auto"``, the default of :class:`~hybridkv.cache.manager.KVCacheManager`'s
``dead_tails``, drops only without lower tiers.  Measurements: docs/architecture.md, "Dead
tails".
"""

from __future__ import annotations

from collections.abc import Sequence

from hybridkv.cache.kinds import KindManager
from hybridkv.cache.pool_base import BlockPool
from hybridkv.cache.request_state import RequestState

__all__ = ["DeadTails"]


class DeadTails:
    """Drops a freed request's unread attention blocks past its longest hit (see module)."""

    __slots__ = ("closed", "pool")

    def __init__(self, managers: Sequence[KindManager], pool: BlockPool) -> None:
        self.pool = pool
        #: The prefix-closed groups (full attention, MLA): where dead tails are dropped.
        self.closed = [m for m in managers if m.prefix_closed]

    def tables(self, rs: RequestState) -> list[list[int]]:
        """The prefix-closed groups' tables of a request about to be freed (taken before its
        references are dropped)."""
        return [list(m.table(rs.groups[m.group_id])) for m in self.closed]

    def drop(self, tables: Sequence[Sequence[int]], hit: int) -> int:
        """Uncache the blocks of ``tables`` (from :meth:`tables`) that lie past ``hit`` tokens
        (the longest hit the request's tokens have now) and that no other request read;
        returns how many were dropped."""
        dropped = 0
        for m, table in zip(self.closed, tables, strict=True):
            first = -(-hit // m.block_size)
            if first >= len(table):
                continue
            g = m.group_id
            dropped += self.pool.uncache(g, self.pool.untouched(g, table[first:]))
        return dropped
