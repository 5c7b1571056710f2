"""The memory layout a plan fixes: groups, block sizes and pools.

This is the contract between the planner (which chooses it), the cache manager (which hands out
block ids inside it) and storage (which backs it with bytes).  No torch.

Block ids
---------
* ``uniform`` and ``pools``: each :class:`PoolPlan` has block ids ``0 .. num_blocks-1`` and
  block ``b`` occupies bytes ``[b * block_bytes, (b + 1) * block_bytes)`` of that pool.  Block
  ``0`` is the null block (a placeholder for skipped positions) and is never allocated.
* ``arena``: one region of ``num_chunks`` chunks of ``chunk_bytes`` (``C``).  Every group
  indexes the whole region with one stride, its ``block_bytes`` (``B``): block ``b`` occupies
  bytes ``[b * B, (b + 1) * B)``, in chunk ``b * B // C`` (:meth:`MemoryLayout.chunk_of_block`).
  When ``B`` divides ``C``, chunk ``c`` holds the ``C / B`` blocks ``[c * C / B, (c + 1) * C /
  B)``.  Otherwise (bounded chunks with a page-size mix, see :mod:`hybridkv.plan.arena`) chunk
  ``c`` lends group ``g`` the ``blocks_per_chunk(g) = C // B - 1`` blocks that start at its
  first whole block ``ceil(c * C / B)`` (:meth:`MemoryLayout.chunk_first_block`): the same
  count in every chunk, losing less than ``2 * B`` bytes per chunk; the ids in between
  (blocks straddling two chunks, or the one extra block some chunks could hold) are never
  handed out.  A group may only use blocks of chunks it currently holds.  Block ``0`` of every
  group is its null block and starts at byte 0, in chunk ``0``.  Only the null blocks of
  attention-like groups are ever read (released or padded table entries); a state group's
  block 0 is never read nor written.  So chunk ``0`` is lent for good to one *null host*
  group (:func:`null_host`), minus the ids that overlap the first ``R`` bytes, ``R`` the
  largest attention-like block: only those bytes (and the chunk's tail) are reserved, not
  the whole chunk.  Past the last whole chunk, ``tail_bytes`` (less than a chunk) are lent
  for good to one *tail host* group (:func:`tail_host`), the one that gets the most bytes
  from them; its ids there are a pseudo-chunk ``num_chunks`` that never changes hands.

Example (arena): groups with 64 KiB and 96 KiB blocks, ``chunk_bytes`` = 192 KiB.  Group 0 has 3
blocks per chunk, group 1 has 2.  Group 1's block 5 is chunk 2, bytes 480..576 KiB.  With
``chunk_bytes`` = 320 KiB instead, group 1 gets ``320 // 96 - 1 = 2`` blocks per chunk: chunk 1
(bytes 320..640 KiB) lends it blocks 4 and 5 (block 3, 288..384 KiB, straddles chunks 0 and 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from math import gcd
from typing import Any, NamedTuple

from hybridkv.errors import PlanError
from hybridkv.specs import CacheKind, CacheSpec, spec_from_dict

__all__ = [
    "NULL_BLOCK_ID",
    "ArenaPlan",
    "ChunkLoan",
    "GroupPlan",
    "MemoryLayout",
    "NullHost",
    "PoolPlan",
    "Strategy",
    "loan_blocks",
    "null_chunk_usable_bytes",
    "null_host",
    "null_loan_blocks",
    "tail_host",
]

#: Block id of the null block in every pool and every arena group.
NULL_BLOCK_ID = 0


class Strategy(StrEnum):
    """How memory is shared between groups."""

    ARENA = "arena"
    UNIFORM = "uniform"
    POOLS = "pools"


@dataclass(frozen=True, kw_only=True)
class GroupPlan:
    """Layers (cache entries) with identical specs, managed with one block table per request.

    ``members`` are ``(layer, slot)`` pairs (see :class:`hybridkv.specs.CacheEntry`).
    ``block_size`` is tokens per manager block; for a state spec it is the checkpoint interval
    (one state slot per block).  ``kernel_block_size`` divides ``block_size``.  ``page_bytes``
    is what one member stores per block: ``spec.bytes_per_block(block_size)``, or more when the
    strategy pads pages.  ``padded_members`` are unused layer slots the ``uniform`` strategy adds
    so every group has the same number of layers.
    """

    group_id: int
    spec: CacheSpec
    members: tuple[tuple[int, int], ...]
    block_size: int
    kernel_block_size: int
    page_bytes: int
    padded_members: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "members", tuple((int(a), int(b)) for a, b in self.members))
        g = f"group {self.group_id}"
        if not self.members:
            raise PlanError(f"GroupPlan.members: {g} has no members")
        if self.spec.stores_nothing:
            raise PlanError(f"GroupPlan.spec: {g} has a spec that stores nothing")
        for name in ("block_size", "kernel_block_size", "page_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise PlanError(f"GroupPlan.{name}: {g} needs a positive integer, got {value!r}")
        if self.block_size % self.kernel_block_size:
            raise PlanError(
                f"GroupPlan.kernel_block_size: {self.kernel_block_size} does not divide "
                f"block_size {self.block_size} in {g}"
            )
        if self.page_bytes < self.spec.bytes_per_block(self.block_size):
            raise PlanError(
                f"GroupPlan.page_bytes: {self.page_bytes} is smaller than the "
                f"{self.spec.bytes_per_block(self.block_size)} bytes one block needs in {g}"
            )
        if self.padded_members < 0:
            raise PlanError(f"GroupPlan.padded_members: must be >= 0, got {self.padded_members}")

    @property
    def layers(self) -> tuple[int, ...]:
        """Layer indices of the members, in member order."""
        return tuple(layer for layer, _ in self.members)

    @property
    def num_members(self) -> int:
        return len(self.members)

    @property
    def block_bytes(self) -> int:
        """Bytes one block id takes: every member's page, padding included."""
        return self.page_bytes * (self.num_members + self.padded_members)

    @property
    def used_block_bytes(self) -> int:
        """Bytes of one block that hold real data (no padded pages or layers)."""
        return self.spec.bytes_per_block(self.block_size) * self.num_members

    @property
    def kernel_blocks_per_block(self) -> int:
        return self.block_size // self.kernel_block_size

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "spec": self.spec.to_dict(),
            "members": [list(m) for m in self.members],
            "block_size": self.block_size,
            "kernel_block_size": self.kernel_block_size,
            "page_bytes": self.page_bytes,
            "padded_members": self.padded_members,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroupPlan:
        return cls(
            group_id=int(data["group_id"]),
            spec=spec_from_dict(data["spec"]),
            members=tuple((int(a), int(b)) for a, b in data["members"]),
            block_size=int(data["block_size"]),
            kernel_block_size=int(data["kernel_block_size"]),
            page_bytes=int(data["page_bytes"]),
            padded_members=int(data.get("padded_members", 0)),
        )


@dataclass(frozen=True, kw_only=True)
class PoolPlan:
    """A pool of equal-size blocks shared by ``group_ids`` (uniform: all; pools: one)."""

    pool_id: int
    group_ids: tuple[int, ...]
    block_bytes: int
    num_blocks: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_ids", tuple(int(g) for g in self.group_ids))
        if self.block_bytes <= 0:
            raise PlanError(f"PoolPlan.block_bytes: must be positive, got {self.block_bytes}")
        if self.num_blocks < 2:
            raise PlanError(
                f"PoolPlan.num_blocks: pool {self.pool_id} needs at least 2 blocks (the null "
                f"block and one usable), got {self.num_blocks}"
            )

    @property
    def total_bytes(self) -> int:
        return self.block_bytes * self.num_blocks

    def to_dict(self) -> dict[str, Any]:
        return {
            "pool_id": self.pool_id,
            "group_ids": list(self.group_ids),
            "block_bytes": self.block_bytes,
            "num_blocks": self.num_blocks,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PoolPlan:
        return cls(
            pool_id=int(data["pool_id"]),
            group_ids=tuple(data["group_ids"]),
            block_bytes=int(data["block_bytes"]),
            num_blocks=int(data["num_blocks"]),
        )


class ChunkLoan(NamedTuple):
    """A group a chunk is lent to for good, and the ids it lends: ``[first, end)``."""

    group_id: int
    first: int
    end: int

    def usable_bytes(self, groups: Sequence[GroupPlan]) -> int:
        return (self.end - self.first) * groups[self.group_id].block_bytes


#: The loan of chunk 0 past the null region (:func:`null_host`).
NullHost = ChunkLoan


def null_host(groups: Sequence[GroupPlan], chunk_bytes: int) -> NullHost | None:
    """Which group gets the part of chunk ``0`` past the null region (see the module doc).

    The null region is the largest block of a group whose null block may be read (every
    kind but recurrent state; none when all groups are state).  Each group with at least two
    blocks per chunk could use its ids of chunk ``0`` from the first past that region (never
    id 0); the one that gets the most bytes that way hosts (ties: the lowest group id).
    None when no group would get a block.
    """
    region = max(
        (g.block_bytes for g in groups if g.spec.kind is not CacheKind.STATE),
        default=0,
    )
    best: NullHost | None = None
    best_bytes = 0
    for g in groups:
        bb = g.block_bytes
        end = chunk_bytes // bb - (1 if chunk_bytes % bb else 0)
        if end < 2:
            continue
        first = max(1, -(-region // bb))
        if (end - first) * bb > best_bytes:
            best, best_bytes = NullHost(g.group_id, first, end), (end - first) * bb
    return best


def null_chunk_usable_bytes(groups: Sequence[GroupPlan], chunk_bytes: int) -> int:
    """Bytes of chunk ``0`` the null host can use (0 when the chunk is reserved whole)."""
    host = null_host(groups, chunk_bytes)
    return 0 if host is None else host.usable_bytes(groups)


def tail_host(
    groups: Sequence[GroupPlan], chunk_bytes: int, num_chunks: int, tail_bytes: int
) -> ChunkLoan | None:
    """Which group gets the ``tail_bytes`` past the last of ``num_chunks`` chunks, and the
    ids: those wholly inside them.  Of the groups with at least two blocks per chunk (a group
    with one moves whole chunks, never a loan), the one getting the most bytes hosts (ties:
    the lowest group id); None when no group gets a block."""
    start = chunk_bytes * num_chunks
    best: ChunkLoan | None = None
    best_bytes = 0
    for g in groups:
        bb = g.block_bytes
        if chunk_bytes // bb - (1 if chunk_bytes % bb else 0) < 2:
            continue
        first, end = -(-start // bb), (start + tail_bytes) // bb
        if (end - first) * bb > best_bytes:
            best, best_bytes = ChunkLoan(g.group_id, first, end), (end - first) * bb
    return best


def null_loan_blocks(groups: Sequence[GroupPlan], chunk_bytes: int) -> list[int]:
    """Per group, the blocks of chunk ``0`` it holds for good (the null host's, past the null
    region: :func:`null_host`)."""
    out = [0] * len(groups)
    loan = null_host(groups, chunk_bytes)
    if loan is not None:
        out[loan.group_id] = loan.end - loan.first
    return out


def loan_blocks(
    groups: Sequence[GroupPlan], chunk_bytes: int, num_chunks: int, tail_bytes: int
) -> list[int]:
    """Per group, the blocks it holds for good outside the whole chunks: the null host's of
    chunk ``0`` (:func:`null_loan_blocks`) and the tail host's past the last chunk
    (:func:`tail_host`)."""
    out = null_loan_blocks(groups, chunk_bytes)
    host = tail_host(groups, chunk_bytes, num_chunks, tail_bytes) if num_chunks >= 2 else None
    if host is not None:
        out[host.group_id] += host.end - host.first
    return out


@dataclass(frozen=True, kw_only=True)
class ArenaPlan:
    """One shared region of ``num_chunks`` chunks; chunk 0 holds the null blocks.

    ``tail_bytes`` (``0 <= tail_bytes < chunk_bytes``) follow the last chunk, lent for good to
    the layout's tail host (:func:`tail_host`)."""

    chunk_bytes: int
    num_chunks: int
    tail_bytes: int = 0

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0:
            raise PlanError(f"ArenaPlan.chunk_bytes: must be positive, got {self.chunk_bytes}")
        if self.num_chunks < 2:
            raise PlanError(
                "ArenaPlan.num_chunks: needs at least 2 chunks (the null chunk and one usable), "
                f"got {self.num_chunks}"
            )
        if not 0 <= self.tail_bytes < self.chunk_bytes:
            raise PlanError(
                f"ArenaPlan.tail_bytes: must be in [0, chunk_bytes {self.chunk_bytes}), got "
                f"{self.tail_bytes}"
            )

    @property
    def total_bytes(self) -> int:
        return self.chunk_bytes * self.num_chunks + self.tail_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "chunk_bytes": self.chunk_bytes,
            "num_chunks": self.num_chunks,
            "tail_bytes": self.tail_bytes,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ArenaPlan:
        return cls(
            chunk_bytes=int(data["chunk_bytes"]),
            num_chunks=int(data["num_chunks"]),
            tail_bytes=int(data.get("tail_bytes", 0)),
        )


@dataclass(frozen=True, kw_only=True)
class MemoryLayout:
    """Groups plus where their blocks live.  Validated on construction (raises PlanError).

    ``hash_block_size`` is the token granularity of request hashes (gcd of the group block
    sizes); ``schedule_alignment`` the granularity of cache hits the scheduler sees (lcm).
    """

    strategy: Strategy
    groups: tuple[GroupPlan, ...]
    pools: tuple[PoolPlan, ...] = ()
    arena: ArenaPlan | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "strategy", Strategy(self.strategy))
        groups = tuple(self.groups)
        object.__setattr__(self, "groups", groups)
        object.__setattr__(self, "pools", tuple(self.pools))
        if not groups:
            raise PlanError("MemoryLayout.groups: a layout needs at least one group")
        for i, g in enumerate(groups):
            if g.group_id != i:
                raise PlanError(
                    f"MemoryLayout.groups: group at position {i} has group_id {g.group_id}"
                )
        if self.strategy is Strategy.ARENA:
            self._check_arena()
        else:
            self._check_pools()

    def _check_arena(self) -> None:
        if self.arena is None or self.pools:
            raise PlanError("MemoryLayout: the arena strategy needs `arena` and no `pools`")
        chunk = self.arena.chunk_bytes
        for g in self.groups:
            if chunk % g.block_bytes and chunk < 2 * g.block_bytes:
                raise PlanError(
                    f"ArenaPlan.chunk_bytes: {chunk} holds no whole block of group "
                    f"{g.group_id} in every chunk (block_bytes {g.block_bytes}); give a "
                    f"multiple of it or at least {2 * g.block_bytes}"
                )

    def _check_pools(self) -> None:
        if self.arena is not None or not self.pools:
            raise PlanError(f"MemoryLayout: the {self.strategy} strategy needs `pools`, no arena")
        seen: list[int] = sorted(gid for p in self.pools for gid in p.group_ids)
        if seen != list(range(len(self.groups))):
            raise PlanError(
                f"MemoryLayout.pools: pools must cover every group exactly once, got {seen}"
            )
        for i, pool in enumerate(self.pools):
            if pool.pool_id != i:
                raise PlanError(f"MemoryLayout.pools: pool at position {i} has id {pool.pool_id}")
            for gid in pool.group_ids:
                if self.groups[gid].block_bytes > pool.block_bytes:
                    raise PlanError(
                        f"PoolPlan.block_bytes: pool {i} blocks ({pool.block_bytes} B) are "
                        f"smaller than group {gid}'s {self.groups[gid].block_bytes} B"
                    )
        if self.strategy is Strategy.POOLS and any(len(p.group_ids) != 1 for p in self.pools):
            raise PlanError("MemoryLayout.pools: the pools strategy has one group per pool")

    @property
    def hash_block_size(self) -> int:
        out = 0
        for g in self.groups:
            out = gcd(out, g.block_size)
        return out

    @property
    def schedule_alignment(self) -> int:
        out = 1
        for g in self.groups:
            out = out * g.block_size // gcd(out, g.block_size)
        return out

    def pool_of(self, group_id: int) -> PoolPlan:
        """The pool group ``group_id`` draws from (not for the arena strategy)."""
        for pool in self.pools:
            if group_id in pool.group_ids:
                return pool
        raise PlanError(f"MemoryLayout.pool_of: no pool holds group {group_id}")

    def _arena_plan(self, what: str) -> ArenaPlan:
        if self.arena is None:
            raise PlanError(f"MemoryLayout.{what}: only the arena strategy has chunks")
        return self.arena

    def blocks_per_chunk(self, group_id: int) -> int:
        """Arena only: how many of group ``group_id``'s blocks every chunk lends it."""
        chunk = self._arena_plan("blocks_per_chunk").chunk_bytes
        block = self.groups[group_id].block_bytes
        return chunk // block - (1 if chunk % block else 0)

    def chunk_first_block(self, group_id: int, chunk: int) -> int:
        """Arena only: the first of the ``blocks_per_chunk`` block ids ``chunk`` lends."""
        size = self._arena_plan("chunk_first_block").chunk_bytes
        return -(-chunk * size // self.groups[group_id].block_bytes)

    def chunk_of_block(self, group_id: int, block_id: int) -> int:
        """Arena only: the chunk holding the start of block ``block_id`` of the group."""
        size = self._arena_plan("chunk_of_block").chunk_bytes
        return block_id * self.groups[group_id].block_bytes // size

    def chunk_blocks(self, group_id: int, chunk: int) -> range:
        """Arena only: the block ids ``chunk`` lends group ``group_id``."""
        first = self.chunk_first_block(group_id, chunk)
        return range(first, first + self.blocks_per_chunk(group_id))

    @property
    def null_host(self) -> NullHost | None:
        """Arena only: the group holding chunk ``0`` past the null region (None: reserved)."""
        return null_host(self.groups, self._arena_plan("null_host").chunk_bytes)

    @property
    def null_chunk_usable_bytes(self) -> int:
        """Arena only: bytes of chunk ``0`` the null host can use (0: reserved whole)."""
        chunk = self._arena_plan("null_chunk_usable_bytes").chunk_bytes
        return null_chunk_usable_bytes(self.groups, chunk)

    @property
    def tail_host(self) -> ChunkLoan | None:
        """Arena only: the group holding the bytes past the last whole chunk (None: unused)."""
        arena = self._arena_plan("tail_host")
        return tail_host(self.groups, arena.chunk_bytes, arena.num_chunks, arena.tail_bytes)

    @property
    def null_loan_blocks(self) -> list[int]:
        """Arena only: per group, its blocks of chunk ``0`` (:func:`null_loan_blocks`)."""
        chunk = self._arena_plan("null_loan_blocks").chunk_bytes
        return null_loan_blocks(self.groups, chunk)

    @property
    def loaned_blocks(self) -> list[int]:
        """Arena only: per group, the blocks it holds for good outside the whole chunks, in
        chunk ``0`` and past the last chunk (:func:`loan_blocks`)."""
        arena = self._arena_plan("loaned_blocks")
        return loan_blocks(self.groups, arena.chunk_bytes, arena.num_chunks, arena.tail_bytes)

    @property
    def tail_usable_bytes(self) -> int:
        """Arena only: bytes past the last whole chunk the tail host can use."""
        host = self.tail_host
        return 0 if host is None else host.usable_bytes(self.groups)

    def num_block_ids(self, group_id: int) -> int:
        """Arena only: the size of the group's block-id space, ``total_bytes // block_bytes``
        (one stride over the whole region; ids the group never gets included)."""
        arena = self._arena_plan("num_block_ids")
        return arena.total_bytes // self.groups[group_id].block_bytes

    @property
    def total_bytes(self) -> int:
        """Bytes of backing memory this layout needs."""
        if self.arena is not None:
            return self.arena.total_bytes
        return sum(p.total_bytes for p in self.pools)

    def to_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy.value,
            "groups": [g.to_dict() for g in self.groups],
            "pools": [p.to_dict() for p in self.pools],
            "arena": None if self.arena is None else self.arena.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryLayout:
        arena = data.get("arena")
        return cls(
            strategy=Strategy(data["strategy"]),
            groups=tuple(GroupPlan.from_dict(g) for g in data["groups"]),
            pools=tuple(PoolPlan.from_dict(p) for p in data.get("pools", ())),
            arena=None if arena is None else ArenaPlan.from_dict(arena),
        )
