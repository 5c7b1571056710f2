"""Capacity and byte accounting of a :class:`MemoryLayout` for max-length requests.

Capacity rules (``need[g]`` = :func:`hybridkv.plan.need.blocks_for_request` of group ``g``):

* pools (``uniform`` and ``pools``): ``N`` requests fit when every pool has
  ``N * sum(need[g] for g in pool) <= num_blocks - 1`` (block 0 is the null block).
* arena: ``N`` requests fit when ``sum_g ceil(max(0, N * need[g] - loaned[g]) /
  blocks_per_chunk[g]) <= num_chunks - 1``: each group carves whole chunks (chunk 0 is the
  null chunk) for what its blocks of chunk 0 (the null host's:
  :func:`hybridkv.plan.layout.null_loan_blocks`) do not hold.  The chunk-size search does
  not count the tail host's ids past the last chunk: one that counted them would prefer
  huge chunks whose tail locks a third of the budget to one group (Zamba2-7B-like: 3 chunks
  of 2 GiB); it breaks ties between chunk sizes of equal capacity with them.  The chosen
  layout's capacity counts them (``loaned`` of
  :func:`hybridkv.plan.layout.loan_blocks`): the pool hands them to their host like chunk
  0's loan, and without them the arena planned fewer requests than ``uniform`` on budgets
  whose tail held a request's worth (DeepSeek-V3, fp8, 24 GiB: 178 against 179).

Byte ledger at the capacity point ``N`` (every field >= 0; they sum to the budget exactly):

``memory_bytes = allocated + padded_layers + padded_pages + chunk_tails + reserved + free``

* ``allocated``: real data bytes of the blocks ``N`` requests hold (``used_block_bytes``).
* ``padded_layers`` / ``padded_pages``: padding inside those held blocks (unused layer slots
  of the ``uniform`` strategy; page padding).
* ``chunk_tails``: the budget remainder that is no whole chunk/block (per pool for ``pools``;
  in the arena, what the tail host cannot use past the last chunk), plus, in the arena, the
  bytes of each held chunk that are no whole block of its group.
* ``reserved``: the null block of each pool, or what chunk 0 of an arena lends nobody (all
  of it but the null host's blocks past the null region).
* ``free``: usable bytes left over (free blocks, free chunks, spare blocks of held chunks,
  the null host's and the tail host's blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from hybridkv.errors import BudgetTooSmallError, PlanError
from hybridkv.plan.layout import MemoryLayout
from hybridkv.plan.search import first_true
from hybridkv.units import format_bytes, format_bytes_exact

__all__ = [
    "Ledger",
    "Waste",
    "arena_capacity",
    "arena_fits",
    "ledger",
    "pool_capacity",
    "too_small_error",
]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True)
class Waste:
    """Bytes of the budget that can never hold data at the capacity point, by cause."""

    padded_layers: int = 0
    padded_pages: int = 0
    chunk_tails: int = 0
    reserved: int = 0

    @property
    def total(self) -> int:
        return self.padded_layers + self.padded_pages + self.chunk_tails + self.reserved

    def to_dict(self) -> dict[str, int]:
        return {
            "padded_layers": self.padded_layers,
            "padded_pages": self.padded_pages,
            "chunk_tails": self.chunk_tails,
            "reserved": self.reserved,
            "total": self.total,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Waste:
        return cls(
            padded_layers=int(data["padded_layers"]),
            padded_pages=int(data["padded_pages"]),
            chunk_tails=int(data["chunk_tails"]),
            reserved=int(data["reserved"]),
        )


class Ledger(NamedTuple):
    """Where every byte of the budget goes at the capacity point (see the module docstring)."""

    allocated: int
    waste: Waste
    free: int


def pool_capacity(layout: MemoryLayout, need: Sequence[int]) -> int:
    """Most max-length requests the pools of ``layout`` hold (pool strategies only)."""
    out: int | None = None
    for pool in layout.pools:
        demand = sum(need[g] for g in pool.group_ids)
        if demand > 0:
            fit = (pool.num_blocks - 1) // demand
            out = fit if out is None else min(out, fit)
    return 0 if out is None else out


def arena_fits(
    blocks_per_chunk: Sequence[int],
    usable_chunks: int,
    need: Sequence[int],
    requests: int,
    loaned: Sequence[int] | None = None,
) -> bool:
    """True when ``requests`` requests fit in ``usable_chunks`` chunks (whole chunks per
    group) plus ``loaned[g]`` blocks each group holds outside them (None: none)."""
    chunks = 0
    for g, (per_chunk, blocks) in enumerate(zip(blocks_per_chunk, need, strict=True)):
        held = requests * blocks - (loaned[g] if loaned is not None else 0)
        if held > 0:
            chunks += _cdiv(held, per_chunk)
    return chunks <= usable_chunks


def arena_capacity(
    blocks_per_chunk: Sequence[int],
    usable_chunks: int,
    need: Sequence[int],
    loaned: Sequence[int] | None = None,
) -> int:
    """Largest ``N`` with :func:`arena_fits` (monotone in ``N``, found by bisection)."""

    def fits(n: int) -> bool:
        return arena_fits(blocks_per_chunk, usable_chunks, need, n, loaned)

    if usable_chunks <= 0 or not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    return first_true(lambda n: not fits(n), lo, hi) - 1  # the last that fits


def ledger(layout: MemoryLayout, need: Sequence[int], requests: int, memory_bytes: int) -> Ledger:
    """The byte ledger of ``layout`` holding ``requests`` max-length requests.

    ``need`` is per group; ``requests`` must fit (else :class:`PlanError`).  Pure.
    """
    if layout.total_bytes > memory_bytes:
        raise PlanError(
            f"memory_bytes: the layout takes {layout.total_bytes} B, more than the budget "
            f"{memory_bytes} B"
        )
    out = _arena_ledger if layout.arena is not None else _pool_ledger
    result = out(layout, need, requests, memory_bytes)
    if result.free < 0:
        raise PlanError(f"requests: {requests} requests do not fit this layout")
    return result


def _held_block_bytes(layout: MemoryLayout, gid: int, held: int) -> tuple[int, int, int]:
    """(allocated, padded_layers, padded_pages) bytes of ``held`` blocks of group ``gid``."""
    g = layout.groups[gid]
    raw = g.spec.bytes_per_block(g.block_size)
    return (
        held * g.used_block_bytes,
        held * g.page_bytes * g.padded_members,
        held * (g.page_bytes - raw) * g.num_members,
    )


def _pool_ledger(
    layout: MemoryLayout, need: Sequence[int], requests: int, memory_bytes: int
) -> Ledger:
    allocated = padded_layers = padded_pages = reserved = free = 0
    for pool in layout.pools:
        used_blocks = 0
        for gid in pool.group_ids:
            held = requests * need[gid]
            used_blocks += held
            data, layers, pages = _held_block_bytes(layout, gid, held)
            allocated += data
            padded_layers += layers
            # A pool block larger than the group's block is padding of its pages too.
            padded_pages += pages + held * (pool.block_bytes - layout.groups[gid].block_bytes)
        reserved += pool.block_bytes
        free += (pool.num_blocks - 1 - used_blocks) * pool.block_bytes
    waste = Waste(
        padded_layers=padded_layers,
        padded_pages=padded_pages,
        chunk_tails=memory_bytes - layout.total_bytes,
        reserved=reserved,
    )
    return Ledger(allocated=allocated, waste=waste, free=free)


def _arena_ledger(
    layout: MemoryLayout, need: Sequence[int], requests: int, memory_bytes: int
) -> Ledger:
    arena = layout.arena
    assert arena is not None  # dispatched on it
    chunk = arena.chunk_bytes
    allocated = padded_layers = padded_pages = leftovers = free = held_chunks = 0
    usable = layout.null_chunk_usable_bytes  # chunk 0 past the null region
    tail = layout.tail_usable_bytes  # lent to the tail host past the last chunk: free
    free += usable + tail  # less what the held blocks take of chunk 0, below
    for g, loan in zip(layout.groups, layout.loaned_blocks, strict=True):
        per_chunk = layout.blocks_per_chunk(g.group_id)
        held = requests * need[g.group_id]
        in_loans = min(held, loan)  # the loans hold blocks first
        free -= in_loans * g.block_bytes
        chunks = _cdiv(held - in_loans, per_chunk)
        held_chunks += chunks
        data, layers, pages = _held_block_bytes(layout, g.group_id, held)
        allocated += data
        padded_layers += layers
        padded_pages += pages
        leftovers += chunks * (chunk - per_chunk * g.block_bytes)
        free += (chunks * per_chunk - (held - in_loans)) * g.block_bytes
    free += (arena.num_chunks - 1 - held_chunks) * chunk
    waste = Waste(
        padded_layers=padded_layers,
        padded_pages=padded_pages,
        chunk_tails=memory_bytes - arena.chunk_bytes * arena.num_chunks - tail + leftovers,
        reserved=chunk - usable,
    )
    return Ledger(allocated=allocated, waste=waste, free=free)


def too_small_error(
    *,
    strategy: str,
    memory_bytes: int,
    max_model_len: int,
    min_bytes: int,
    data_bytes: int,
    unit: str,
) -> PlanError:
    """The error for a budget that holds no request of ``max_model_len`` tokens.

    ``min_bytes`` is the smallest budget that holds one (with ``unit`` reserved), and
    ``data_bytes`` the exact cache bytes one such request needs.
    """
    # Mostly reserved bytes (huge blocks make a huge null unit): the block size is the lever,
    # and for an arena's null chunk the chunk alignment too.
    levers = ["memory", "a shorter max_model_len"]
    if min_bytes >= 2 * data_bytes:
        levers.append("a smaller block_size")
        if unit == "chunk":
            levers.append("a smaller chunk_alignment")
    lever = ", ".join(levers[:-1]) + " or " + levers[-1]
    return BudgetTooSmallError(
        f"memory_bytes: {format_bytes_exact(memory_bytes)} holds no request of "
        f"max_model_len {max_model_len} with the {strategy} strategy; one request needs "
        f"{format_bytes_exact(min_bytes)} including the reserved null {unit} (its "
        f"cache data alone is {data_bytes} B), {format_bytes(min_bytes - memory_bytes)} more "
        f"than given; give at least that much {lever}",
        min_bytes,
    )
