"""The ``arena`` strategy: one region of equal chunks that every group carves into blocks.

``chunk_bytes`` is a common multiple of every group's ``block_bytes`` and of
``chunk_alignment`` (64 KiB by default; 2 MiB gives chunks that match the CUDA virtual-memory
granularity, see :mod:`hybridkv.plan.options`), so a chunk holds a whole
number of blocks of any group and can be handed from one group to another when it is empty:
memory flows to whichever kind the workload needs, with no fixed split and no padding.
``num_chunks = memory_bytes // chunk_bytes``; chunk 0 holds the null blocks and lends the rest
to the null host group (:func:`hybridkv.plan.layout.null_host`; only the null region, the
largest attention block, is reserved).  The budget past the last whole chunk is lent for good
to the group that gets the most whole blocks from it (:func:`hybridkv.plan.layout.tail_host`),
so large chunks lose no more than a block there.  When no aligned
chunk meets the waste aim below (DeepSeek-V3: 61 MLA layers make every aligned chunk at least
1.07 GiB), the alignment is halved down to 4 KiB until one does; a finer alignment is also
taken where it holds more max-length requests (rounding each group to whole coarse chunks can
leave one out: Kimi-Linear-48B-A3B at 141 GiB and tp 8 holds 141 requests with 64 KiB-aligned
chunks of 1.29 GiB and 142 with 16 KiB-aligned ones of 330 MiB).  The on-demand arena then
shares the boundary pages of neighbouring chunks.

The exact lcm can be too coarse: 36 gated-DeltaNet layers with a 2,146,304-byte state make a
block of 36 * 2^16 * 131 bytes, and an lcm of gigabytes.  The plan aims at >= 64 chunks and
at most 1% of the budget lost to chunk tails, the null region and padding.  When the exact lcm
misses that aim, state pages are padded up to a rounder size (``d * 2^j`` for small odd
``d``, at most doubling a page), one state group at a time (coordinate descent).  The
candidate holding the most max-length requests wins; among equals, one meeting the aim beats
one missing it; among those meeting it, the least relative padding wins (padding costs most
when the workload is many short requests, which hold state slots but few attention blocks);
then the least waste, then the smaller chunk.
Scaling attention block sizes never helps: it multiplies a block's bytes, and ``lcm(m*x, y)``
is a multiple of ``lcm(x, y)``, so it can only grow the chunk; the planner does not do it.

**One state slot per chunk.**  Among candidates of equal capacity that meet the aim, one whose
chunk is exactly one slot of every state group wins, if that costs at most
:data:`ONE_SLOT_MAX_PADDING` of padding.  Slots that share a chunk fragment it: a running
request's slot pins its chunk, so the chunk cannot go to the attention group, and a new
request's slot needs a chunk whose slots are free or evictable.  Under memory pressure,
admission then stalls while memory is free.  The candidate pads each state group's pages to
``chunk / layers``, where ``chunk`` is the least multiple of the alignment, of every other
group's block and of every state group's layer count times its largest element size (so the
padded page stays a whole number of elements) that holds the largest slot.  Layouts
whose state slots already fill a chunk whole are unchanged.

Measured in the ``benchmarks/compare_vllm.py`` loop (Mooncake conversation trace, 2,000
requests, 16 GiB):
- Nemotron-H-8B: 83 chunks of 8 slots became 661 chunks of one slot (pages +1.15%).
  Steps went from 17,923 to 16,726 (vLLM 16,758) and preemptions from 19 to 0, at the same
  hit rate (3.68%).
- Qwen3-Next-80B-A3B: 2 slots per chunk became 1 (pages +3.0%).  Steps went from 22,533 to
  20,497 (vLLM 21,174), and the hit rate from 3.62% to 3.64%.
- Jamba-v0.1 is unchanged: one slot per chunk would pad its pages by 33%.

Example: two groups of 12 layers with 32 KiB pages (384 KiB blocks) give 384 KiB chunks of one
block each with the default 64 KiB alignment, or 6 MiB chunks of 16 blocks with a 2 MiB one.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from math import lcm
from typing import NamedTuple

from hybridkv.plan.accounting import arena_capacity, too_small_error
from hybridkv.plan.grouping import (
    BuiltLayout,
    SpecGroup,
    base_group_plans,
    element_alignment,
    is_state,
)
from hybridkv.plan.layout import (
    ArenaPlan,
    GroupPlan,
    MemoryLayout,
    Strategy,
    null_chunk_usable_bytes,
    null_loan_blocks,
    tail_host,
)
from hybridkv.plan.need import blocks_for_request
from hybridkv.plan.options import PlanOptions
from hybridkv.plan.search import first_true

__all__ = [
    "ARENA_MAX_WASTE_FRACTION",
    "ARENA_MIN_CHUNKS",
    "ONE_SLOT_MAX_PADDING",
    "plan_arena",
    "state_page_candidates",
]

logger = logging.getLogger(__name__)

#: The arena aims at no fewer chunks than this ...
ARENA_MIN_CHUNKS = 64
#: ... and at most this fraction of the budget in chunk tails, null region and padding.
ARENA_MAX_WASTE_FRACTION = 0.01
#: The most relative page padding a chunk of one slot of every state group may cost and
#: still win over candidates that are otherwise equal (see the module docstring).
ONE_SLOT_MAX_PADDING = 0.05
#: Odd factors ``d`` of the rounder page sizes ``d * 2^j`` tried for state pages.
_ODD_FACTORS = (1, 3, 5, 7, 9, 15)
#: Passes of coordinate descent over the state groups.
_PASSES = 3


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _Candidate(NamedTuple):
    groups: tuple[GroupPlan, ...]
    chunk_bytes: int
    num_chunks: int
    capacity: int
    waste: int  # chunk tails + null region + page padding at the capacity point, bytes
    min_bytes: int  # smallest budget holding one request with this chunk size
    tail_bytes: int  # past the last whole chunk, lent to the tail host (plan.layout.tail_host)
    with_tail: int  # the capacity counting the tail host's blocks too (the plan's)

    def score(
        self, memory_bytes: int, one_slot: bool = True
    ) -> tuple[int, int, bool, bool, float, int, int]:
        """Larger is better: capacity, then capacity counting the tail host's blocks (the
        plan's; not first, or huge chunks whose tail one group holds win), then meeting the
        aim, then (when it is met, and
        ``one_slot``) one slot of every state group per chunk within
        :data:`ONE_SLOT_MAX_PADDING`, then the least relative page padding, then the least
        waste, then the smaller chunk."""
        aim = self.meets_aim(memory_bytes)
        one = aim and one_slot and self.one_slot
        return (
            self.capacity,
            self.with_tail,
            aim,
            one,
            -self.padding if aim else 0.0,
            -self.waste,
            -self.chunk_bytes,
        )

    @property
    def one_slot(self) -> bool:
        """Whether every state group's block is the whole chunk, within the padding allowed
        (False without state groups)."""
        states = [g for g in self.groups if is_state(g.spec)]
        return (
            bool(states)
            and all(g.block_bytes == self.chunk_bytes for g in states)
            and self.padding <= ONE_SLOT_MAX_PADDING
        )

    @property
    def padding(self) -> float:
        """The largest relative padding of any group's block (0.0 when nothing is padded)."""
        return max((g.block_bytes - g.used_block_bytes) / g.used_block_bytes for g in self.groups)

    def meets_aim(self, memory_bytes: int) -> bool:
        return (
            self.num_chunks >= ARENA_MIN_CHUNKS
            and self.waste <= memory_bytes * ARENA_MAX_WASTE_FRACTION
        )


def state_page_candidates(page_bytes: int, align: int = 1) -> list[int]:
    """Padded sizes tried for a state page: ``page_bytes`` rounded up to ``d * 2^j``.

    Sorted, starting with ``page_bytes`` itself, none above ``2 * page_bytes``; only multiples
    of ``align`` (the group's largest element size, :func:`element_alignment`: a page that is
    not one leaves the next member's tensors misaligned).
    """
    out = {page_bytes}
    for odd in _ODD_FACTORS:
        step = odd
        while step <= 2 * page_bytes:
            padded = _cdiv(page_bytes, step) * step
            if padded <= 2 * page_bytes and padded % align == 0:
                out.add(padded)
            step *= 2
    return sorted(out)


def _evaluate(
    groups: tuple[GroupPlan, ...], need: Sequence[int], memory_bytes: int, alignment: int
) -> _Candidate:
    return _evaluate_chunk(
        groups, need, memory_bytes, lcm(alignment, *(g.block_bytes for g in groups))
    )


def _one_slot(
    base: tuple[GroupPlan, ...], need: Sequence[int], memory_bytes: int, alignment: int
) -> _Candidate | None:
    """The candidate whose chunk is one slot of every state group (see the module
    docstring), or None without state groups or where it pads more than allowed."""
    states = [g for g in base if is_state(g.spec)]
    if not states:
        return None
    step = lcm(
        alignment,
        *(g.block_bytes for g in base if not is_state(g.spec)),
        *((g.num_members + g.padded_members) * element_alignment(g.spec) for g in states),
    )
    chunk = _cdiv(max(g.block_bytes for g in states), step) * step
    groups = tuple(
        replace(g, page_bytes=chunk // (g.num_members + g.padded_members))
        if is_state(g.spec)
        else g
        for g in base
    )
    if any(g.block_bytes > (1 + ONE_SLOT_MAX_PADDING) * g.used_block_bytes for g in groups):
        return None
    return _evaluate_chunk(groups, need, memory_bytes, chunk)


def null_chunk_reserved(groups: Sequence[GroupPlan], chunk: int) -> int:
    """Bytes of chunk 0 nobody can use: all of it but what it lends the null host."""
    return chunk - null_chunk_usable_bytes(groups, chunk)


def _lent(chunk: int, block: int) -> int:
    """Blocks of ``block`` bytes every chunk of ``chunk`` bytes lends (see plan.layout)."""
    return chunk // block - (1 if chunk % block else 0)


def _min_bytes(groups: Sequence[GroupPlan], need: Sequence[int], chunk: int) -> int:
    """The least budget that holds one request with chunks of ``chunk`` bytes: the null chunk
    and each group's whole chunks for what the null host's part of chunk 0 does not hold."""
    null_loan = null_loan_blocks(groups, chunk)
    return (
        1
        + sum(
            _cdiv(max(0, n - lent), _lent(chunk, g.block_bytes))
            for g, n, lent in zip(groups, need, null_loan, strict=True)
        )
    ) * chunk


def _evaluate_chunk(
    groups: tuple[GroupPlan, ...], need: Sequence[int], memory_bytes: int, chunk: int
) -> _Candidate:
    per_chunk = [_lent(chunk, g.block_bytes) for g in groups]
    num_chunks = memory_bytes // chunk
    start = num_chunks * chunk
    min_bytes = _min_bytes(groups, need, chunk)
    loaned = null_loan_blocks(groups, chunk)
    capacity = arena_capacity(per_chunk, num_chunks - 1, need, loaned) if num_chunks >= 2 else 0
    padding = sum(
        capacity * n * (g.block_bytes - g.used_block_bytes)
        for g, n in zip(groups, need, strict=True)
    )
    # Bounded chunks: what a chunk lends a group whose block does not divide it is short of
    # the chunk by less than two blocks; count it for the chunks the capacity point uses.
    inside = sum(
        _cdiv(max(0, capacity * n - lent), p) * (chunk - p * g.block_bytes)
        for g, n, lent, p in zip(groups, need, loaned, per_chunk, strict=True)
    )
    host = tail_host(groups, chunk, num_chunks, memory_bytes - start) if num_chunks >= 2 else None
    tail_bytes = 0 if host is None else host.end * groups[host.group_id].block_bytes - start
    lent = 0 if host is None else host.usable_bytes(groups)
    tails = memory_bytes - start - lent  # budget past the chunks the tail host cannot use
    reserved = null_chunk_reserved(groups, chunk)
    with_tail = capacity
    if host is not None:
        loaned[host.group_id] += host.end - host.first
        with_tail = arena_capacity(per_chunk, num_chunks - 1, need, loaned)
    return _Candidate(
        groups,
        chunk,
        num_chunks,
        capacity,
        tails + reserved + padding + inside,
        min_bytes,
        tail_bytes,
        with_tail,
    )


#: Bounded chunk sizes tried: up to this many multiples of the largest block (rounded up to
#: the alignment) and of the smallest aligned chunk holding whole largest blocks.
_BOUNDED_MULTIPLES = 64


def _bounded(
    base: tuple[GroupPlan, ...],
    need: Sequence[int],
    memory_bytes: int,
    alignment: int,
    one_slot: bool = True,
) -> tuple[_Candidate | None, int]:
    """The best bounded chunk, whatever the page-size mix: ``k`` largest blocks rounded up to
    the alignment, or ``k`` times the least aligned multiple of the largest block (which then
    loses nothing to it), ``k = 1 .. 64``; a group whose block does not divide the chunk
    gets ``chunk // block - 1`` blocks of every chunk (see :mod:`hybridkv.plan.layout`).
    Also the least budget holding one request with any of those sizes (0: none), the ones
    too large for ``memory_bytes`` included."""
    largest = max(g.block_bytes for g in base)
    whole = lcm(largest, alignment)
    sizes = {_cdiv(k * largest, alignment) * alignment for k in range(1, _BOUNDED_MULTIPLES + 1)}
    sizes.update(k * whole for k in range(1, _BOUNDED_MULTIPLES + 1))
    best: _Candidate | None = None
    least = 0
    for chunk in sorted(sizes):
        if any(chunk % g.block_bytes and chunk < 2 * g.block_bytes for g in base):
            continue
        if memory_bytes // chunk < 2:
            low = _min_bytes(base, need, chunk)
            least = low if not least else min(least, low)
            continue
        cand = _evaluate_chunk(base, need, memory_bytes, chunk)
        least = cand.min_bytes if not least else min(least, cand.min_bytes)
        if best is None or cand.score(memory_bytes, one_slot) > best.score(memory_bytes, one_slot):
            best = cand
    return best, least


def _search(
    base: tuple[GroupPlan, ...],
    need: Sequence[int],
    memory_bytes: int,
    alignment: int,
    best: _Candidate,
    one_slot: bool = True,
) -> tuple[_Candidate, int]:
    """Coordinate descent over state-page paddings; returns the best and the least min_bytes."""
    least = best.min_bytes
    current = best
    for _ in range(_PASSES):
        improved = False
        for i, group in enumerate(base):
            if not is_state(group.spec):
                continue
            for page in state_page_candidates(group.page_bytes, element_alignment(group.spec)):
                groups = list(current.groups)
                groups[i] = replace(groups[i], page_bytes=page)
                cand = _evaluate(tuple(groups), need, memory_bytes, alignment)
                least = min(least, cand.min_bytes)
                if cand.score(memory_bytes, one_slot) > current.score(memory_bytes, one_slot):
                    current, improved = cand, True
        if not improved:
            break
    return current, least


#: Smallest chunk alignment tried when the requested one wastes too much (a CPU page).
MIN_CHUNK_ALIGNMENT = 4096


def _alignments(requested: int) -> list[int]:
    """``requested`` first, then (powers of two only) halvings down to MIN_CHUNK_ALIGNMENT.

    A chunk aligned to the CUDA VMM granularity commits and releases with no shared pages; a
    smaller alignment is only used when the aligned chunk misses the waste aim.
    """
    out = [requested]
    if requested & (requested - 1) == 0:
        a = requested // 2
        while a >= MIN_CHUNK_ALIGNMENT:
            out.append(a)
            a //= 2
    return out


def _least_holding_one(
    base: tuple[GroupPlan, ...],
    need: Sequence[int],
    options: PlanOptions,
    least: int,
    none_at: int,
) -> int:
    """A budget above ``none_at`` (which holds no request) that the search really plans one
    request in, as small as the search finds.

    A budget's search reports the least ``min_bytes`` of every candidate it evaluated, but the
    candidates it evaluates depend on the budget (page paddings are kept only when they score
    better there), so the budget named may pick another chunk and still hold none: step up to
    what that budget's own search names until one holds a request, then bisect down towards
    ``none_at`` (to 1/4096 of the budget): a lower budget may pick yet another chunk."""

    def holds_one(budget: int) -> tuple[bool, int]:
        best, low, _, _ = _best_candidate(
            base, need, budget, options.chunk_alignment, options.one_slot_chunks
        )
        return best.capacity >= 1, low

    budget, below = least, none_at  # ``below``: a budget that holds none
    for _ in range(64):
        ok, low = holds_one(budget)
        if ok:
            break
        below, budget = budget, low if low > budget else 2 * budget
    else:
        return budget
    # A lower budget may hold one with another chunk: bisect down to it (every budget
    # returned was planned).
    return first_true(lambda b: holds_one(b)[0], below, budget, budget >> 12)


def _best_candidate(
    base: tuple[GroupPlan, ...],
    need: Sequence[int],
    memory_bytes: int,
    chunk_alignment: int,
    one_slot: bool = True,
) -> tuple[_Candidate, int, _Candidate, _Candidate]:
    """The best-scoring candidate for ``memory_bytes``, the least ``min_bytes`` seen, the
    best candidate whose chunks are a common multiple of every group's block, and the best
    one at ``chunk_alignment`` itself."""
    best: _Candidate | None = None
    aligned: _Candidate | None = None
    least = 0
    for alignment in _alignments(chunk_alignment):
        exact = _evaluate(base, need, memory_bytes, alignment)
        found, low = exact, exact.min_bytes
        if not exact.meets_aim(memory_bytes):
            found, low = _search(base, need, memory_bytes, alignment, exact, one_slot)
        one = _one_slot(base, need, memory_bytes, alignment) if one_slot else None
        if one is not None:
            low = min(low, one.min_bytes)
            if one.score(memory_bytes) > found.score(memory_bytes):
                found = one
        least = low if best is None else min(least, low)
        if best is None:
            best = aligned = found
        elif best.meets_aim(memory_bytes):
            # Past the aim, a finer alignment is taken only for more requests: rounding each
            # group to whole coarse chunks can leave one short (Kimi-Linear-48B-A3B, 141 GiB,
            # tp 8: 141 requests with 64 KiB-aligned chunks of 1.29 GiB, 142 with 32 KiB).
            if found.meets_aim(memory_bytes) and found.with_tail > best.with_tail:
                best = found
        elif found.score(memory_bytes, one_slot) > best.score(memory_bytes, one_slot):
            best = found
    assert best is not None and aligned is not None
    lcm_best = best
    for alignment in _alignments(chunk_alignment):
        if best.meets_aim(memory_bytes):
            break
        bounded, low = _bounded(base, need, memory_bytes, alignment, one_slot)
        if low:
            least = min(least, low)
        if bounded is not None and bounded.score(memory_bytes, one_slot) > best.score(
            memory_bytes, one_slot
        ):
            best = bounded
    return best, least, lcm_best, aligned


def plan_arena(
    groups: tuple[SpecGroup, ...], options: PlanOptions, memory_bytes: int, max_model_len: int
) -> BuiltLayout:
    """Arena layout for ``groups`` (see the module docstring).  Pure.

    Raises :class:`PlanError` when not even one request of ``max_model_len`` tokens fits,
    naming the smallest budget that would hold one.
    """
    base = base_group_plans(groups, options)
    need = [blocks_for_request(g, max_model_len) for g in base]
    best, least, lcm_best, aligned = _best_candidate(
        base, need, memory_bytes, options.chunk_alignment, options.one_slot_chunks
    )
    exact_chunk = lcm(options.chunk_alignment, *(g.block_bytes for g in base))
    alignment = options.chunk_alignment
    if best.capacity < 1:
        raise too_small_error(
            strategy=Strategy.ARENA.value,
            memory_bytes=memory_bytes,
            max_model_len=max_model_len,
            min_bytes=_least_holding_one(
                base, need, options, max(least, memory_bytes + 1), memory_bytes
            ),
            data_bytes=sum(g.num_members * g.spec.resident_bytes(max_model_len) for g in base),
            unit="chunk",
        )
    padded: dict[tuple[int, int], list[int]] = {}
    for g, raw in zip(best.groups, base, strict=True):
        if g.page_bytes != raw.page_bytes:
            padded.setdefault((raw.page_bytes, g.page_bytes), []).append(g.group_id)
    why = " (one state slot per chunk)" if best.one_slot else ""
    notes = [
        f"arena: state pages of group{'s' if len(ids) > 1 else ''} "
        f"{', '.join(map(str, ids))} padded from {old} B to {new} B "
        f"(+{100 * (new - old) / old:.2f}%; chunks of {best.chunk_bytes} B instead of "
        f"{exact_chunk} B){why}"
        for (old, new), ids in padded.items()
    ]
    if best is not lcm_best:
        short = [
            f"group {g.group_id} {_lent(best.chunk_bytes, g.block_bytes)} blocks"
            for g in best.groups
            if best.chunk_bytes % g.block_bytes
        ]
        notes.append(
            f"arena: bounded chunks of {best.chunk_bytes} B ({best.capacity} max-length "
            f"requests) instead of a common multiple of every group's block "
            f"({lcm_best.chunk_bytes} B, {lcm_best.capacity} requests, "
            f"{100 * lcm_best.waste / memory_bytes:.1f}% lost); a chunk lends "
            + ", ".join(short)
            + " (less than two blocks short of the chunk)"
        )
    if best.chunk_bytes % alignment:
        why = (
            f"would hold {aligned.with_tail} max-length requests, not {best.with_tail}"
            if aligned.meets_aim(memory_bytes)
            else f"would lose more than {100 * ARENA_MAX_WASTE_FRACTION:.0f}% of the budget"
        )
        notes.append(
            f"arena: chunks of {best.chunk_bytes} B are not multiples of the {alignment} B "
            f"chunk alignment (a {alignment} B aligned chunk {why}); on-demand memory shares "
            "the boundary pages of neighbouring chunks"
        )
    if not best.meets_aim(memory_bytes):
        notes.append(
            f"arena: {best.num_chunks} chunks of {best.chunk_bytes} B lose "
            f"{100 * best.waste / memory_bytes:.2f}% of the budget to chunk tails, the null "
            f"region and padding (aim: >= {ARENA_MIN_CHUNKS} chunks, <= "
            f"{100 * ARENA_MAX_WASTE_FRACTION:.0f}%); "
            + (
                "no state-page padding does better"
                if any(is_state(g.spec) for g in base)
                else "only state pages are padded and this model has none"
            )
        )
    for note in notes:
        logger.info("%s", note)
    layout = MemoryLayout(
        strategy=Strategy.ARENA,
        groups=best.groups,
        arena=ArenaPlan(
            chunk_bytes=best.chunk_bytes, num_chunks=best.num_chunks, tail_bytes=best.tail_bytes
        ),
    )
    return BuiltLayout(layout, tuple(notes))
