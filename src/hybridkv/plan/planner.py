"""Entry point: :func:`make_plan` turns a model and a memory budget into a :class:`Plan`.

Flow: validate the options -> group the model's cache entries by spec
(:mod:`~hybridkv.plan.grouping`) -> let the strategy choose block sizes, pages and pools
(:mod:`~hybridkv.plan.arena`, :mod:`~hybridkv.plan.uniform`, :mod:`~hybridkv.plan.pools`) ->
count how many max-length requests fit and where every byte goes
(:mod:`~hybridkv.plan.accounting`).

Example::

    plan = make_plan(model, memory_bytes=40 << 30, max_model_len=131072)
    plan.capacity.max_concurrent_requests, plan.waste.total, plan.utilisation
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from hybridkv.errors import PlanError
from hybridkv.plan.accounting import Ledger, arena_capacity, ledger, pool_capacity
from hybridkv.plan.arena import plan_arena
from hybridkv.plan.grouping import (
    BuiltLayout,
    SpecGroup,
    check_model,
    group_entries,
    is_state,
    split_state_groups,
)
from hybridkv.plan.layout import MemoryLayout, Strategy
from hybridkv.plan.need import blocks_for_request
from hybridkv.plan.options import (
    AUTO_STATE_SPLIT,
    DEFAULT_CHUNK_ALIGNMENT,
    PlanOptions,
    check_positive,
    ratios_arg,
)
from hybridkv.plan.pools import plan_pools
from hybridkv.plan.result import Capacity, PhysicalNeed, Plan
from hybridkv.plan.uniform import plan_uniform
from hybridkv.specs import MAX_TOKENS, ModelSpec, StateSpec
from hybridkv.units import format_bytes

__all__ = [
    "AUTO_SPLIT",
    "AUTO_SPLIT_CAPACITY",
    "AUTO_SPLIT_MAX_CHUNKS",
    "AUTO_SPLIT_MIN_SLOT_BYTES",
    "auto_state_split",
    "make_plan",
    "parse_strategy",
]

_Builder = Callable[[tuple[SpecGroup, ...], PlanOptions, int, int], BuiltLayout]

#: strategy -> layout builder ``(groups, options, memory_bytes, max_model_len)``.
STRATEGIES: dict[Strategy, _Builder] = {
    Strategy.ARENA: plan_arena,
    Strategy.UNIFORM: plan_uniform,
    Strategy.POOLS: plan_pools,
}


#: ``state_split="auto"``: an arena of fewer chunks than this ...
AUTO_SPLIT_MAX_CHUNKS = 512
#: ... where a state group's slot, at least this large, takes a whole chunk ...
AUTO_SPLIT_MIN_SLOT_BYTES = 32 << 20
#: ... is planned again with each state group cut in this many (see :func:`auto_state_split`).
AUTO_SPLIT = 4
#: ``state_split="auto"`` also cuts an arena where fewer requests of ``max_model_len`` tokens
#: than this fit the budget: running requests then hold most of it, and a whole-chunk state
#: slot strands what they leave (see :func:`auto_state_split`).
AUTO_SPLIT_CAPACITY = 16


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def auto_state_split(layout: MemoryLayout, capacity: int | None = None) -> int:
    """The ``state_split`` the planner uses for ``"auto"``, judged on the unsplit layout.

    :data:`AUTO_SPLIT` for an ``arena`` with a state group of several layers where fewer
    than :data:`AUTO_SPLIT_CAPACITY` requests of ``max_model_len`` tokens fit
    (``capacity``, the unsplit plan's; None: not judged); also for an ``arena`` of fewer
    than :data:`AUTO_SPLIT_MAX_CHUNKS` chunks
    where some state group of several layers has slots of at least
    :data:`AUTO_SPLIT_MIN_SLOT_BYTES` that each take a whole chunk; 1 otherwise.  Such a slot
    can only go where no referenced block is left in a chunk, and attention blocks land
    wherever the LRU evicts, so about half the budget sat unreferenced under load; cut in
    four, a chunk holds several slots of a group and the running slots fill it.  But a chunk
    is evicted whole, with every checkpoint part in it, so where chunks are many or slots
    small the split only costs hits.  Measured on the Mooncake trace (docs/architecture.md,
    section 5): it pays for Qwen3-Next-80B-A3B (74.2 MiB slots, 110 to 441 chunks at 8-32
    GiB) and Nemotron-H-8B at 8 GiB (98 MiB slots, 83 chunks).  Where the budget holds few
    full-length requests the running ones keep most chunks pinned whatever the slot size
    (Jamba-v0.1, 15.8 MiB slots; Nemotron-H-8B, two slots a chunk): in vLLM's scheduling loop
    on the Mooncake trace at 16 GiB (capacity 7 at 131072 tokens) the unsplit arena refused
    admissions at a median 52-61% of the budget referenced and served the trace in 17-38%
    more steps than vLLM; cut in four it matched vLLM's steps with slightly more hits
    (docs/vllm.md).  Where many fit (64 GiB: 20-31), the cache holds the memory and a split
    only costs hits (Jamba-v0.1 12.64% -> 11.96%).  :func:`make_plan` keeps a split only
    where it plans as many requests and wastes at most 1% of the budget (or no more than the
    unsplit plan)."""
    return _auto_split(layout, capacity)[0]


def _auto_split(layout: MemoryLayout, capacity: int | None) -> tuple[int, str]:
    """:func:`auto_state_split` with the reason for a cut ("" for none)."""
    arena = layout.arena
    if arena is None:
        return 1, ""
    splittable = any(is_state(g.spec) and len(g.members) > 1 for g in layout.groups)
    if splittable and capacity is not None and capacity < AUTO_SPLIT_CAPACITY:
        return AUTO_SPLIT, (
            f"{capacity} requests of max_model_len fit the arena, fewer than "
            f"{AUTO_SPLIT_CAPACITY}: running requests would pin the chunks a whole state slot needs"
        )
    if arena.num_chunks >= AUTO_SPLIT_MAX_CHUNKS:
        return 1, ""
    for g in layout.groups:
        if (
            is_state(g.spec)
            and len(g.members) > 1
            and g.block_bytes >= AUTO_SPLIT_MIN_SLOT_BYTES
            and layout.blocks_per_chunk(g.group_id) == 1
        ):
            return AUTO_SPLIT, (
                f"group {g.group_id}'s {format_bytes(g.block_bytes)} state slot takes a whole "
                f"chunk of an arena of {arena.num_chunks} chunks"
            )
    return 1, ""


def _cut_where_none_fits(
    kind: Strategy,
    groups: tuple[SpecGroup, ...],
    options: PlanOptions,
    memory_bytes: int,
    max_model_len: int,
) -> tuple[MemoryLayout, tuple[str, ...], PlanOptions] | None:
    """``state_split="auto"`` where no request fits the whole state groups: the arena with
    each cut in :data:`AUTO_SPLIT` (layout, notes, options), or None where that holds none
    either or nothing can be cut."""
    if kind is not Strategy.ARENA or not any(
        is_state(g.spec) and len(g.members) > 1 for g in groups
    ):
        return None
    options = replace(options, state_split=AUTO_SPLIT)
    try:
        layout, notes = STRATEGIES[kind](
            split_state_groups(groups, AUTO_SPLIT), options, memory_bytes, max_model_len
        )
    except PlanError:
        return None
    why = f"state_split auto: {AUTO_SPLIT} (no request of max_model_len fits whole)"
    return layout, (*notes, why), options


def _sized(layout: MemoryLayout, max_model_len: int, memory_bytes: int) -> tuple[Capacity, Ledger]:
    """The layout's capacity for requests of ``max_model_len`` tokens, and its byte ledger."""
    need = tuple(blocks_for_request(g, max_model_len) for g in layout.groups)
    capacity = _capacity(layout, need, max_model_len)
    return capacity, ledger(layout, need, capacity.max_concurrent_requests, memory_bytes)


def parse_strategy(value: Strategy | str) -> Strategy:
    """``value`` as a :class:`Strategy`; raises :class:`PlanError` listing the valid names."""
    try:
        return Strategy(value)
    except ValueError:
        valid = ", ".join(s.value for s in Strategy)
        raise PlanError(f"strategy: unknown strategy {value!r}; valid: {valid}") from None


def _capacity(layout: MemoryLayout, need: tuple[int, ...], max_model_len: int) -> Capacity:
    if layout.arena is not None:
        per_chunk = tuple(layout.blocks_per_chunk(g.group_id) for g in layout.groups)
        loaned = layout.loaned_blocks  # chunk 0's and the tail's, for good
        n = arena_capacity(per_chunk, layout.arena.num_chunks - 1, need, loaned)
        in_use = tuple(n * b for b in need)
        return Capacity(
            max_concurrent_requests=n,
            max_resident_tokens=n * max_model_len,
            blocks_per_request=need,
            blocks_in_use=in_use,
            num_chunks=layout.arena.num_chunks,
            blocks_per_chunk=per_chunk,
            chunks_in_use=tuple(
                _cdiv(max(0, u - lent), p)
                for u, lent, p in zip(in_use, loaned, per_chunk, strict=True)
            ),
        )
    n = pool_capacity(layout, need)
    return Capacity(
        max_concurrent_requests=n,
        max_resident_tokens=n * max_model_len,
        blocks_per_request=need,
        blocks_in_use=tuple(n * b for b in need),
        pool_blocks=tuple(p.num_blocks for p in layout.pools),
    )


def make_plan(
    model: ModelSpec,
    *,
    memory_bytes: int,
    max_model_len: int,
    strategy: Strategy | str = Strategy.ARENA,
    block_size: int = 16,
    kernel_block_size: int | None = None,
    state_block_size: int | None = None,
    pool_ratios: Sequence[float] | None = None,
    chunk_alignment: int = DEFAULT_CHUNK_ALIGNMENT,
    state_split: int | str = AUTO_STATE_SPLIT,
    one_slot_chunks: bool = True,
) -> Plan:
    """Plan ``model``'s cache in ``memory_bytes`` bytes for requests of ``max_model_len`` tokens.

    ``block_size`` (tokens) applies to attention/MLA groups, ``state_block_size`` (tokens, the
    checkpoint interval) to state groups, ``kernel_block_size`` (tokens, must divide
    ``block_size``) to attention kernels; ``pool_ratios`` (``pools`` only) weigh the pools;
    ``chunk_alignment`` (bytes) is the arena chunk granularity; ``state_split`` cuts each
    state group into that many groups of layers (``arena`` and ``pools``), or with
    ``"auto"`` lets :func:`auto_state_split` choose (``plan.options.state_split`` says what
    was used); ``one_slot_chunks`` lets the arena pad state pages for one slot per chunk
    (False where the cache keeps dead tails).  See :mod:`hybridkv.plan.options` for the
    defaults.

    Raises :class:`PlanError` naming the field for a ``model`` that is not a
    :class:`ModelSpec` (a name: resolve it with :func:`hybridkv.models.resolve_model`), a
    non-positive budget, length or block size,
    a kernel block size that does not divide the block size, bad ratios, a model with no
    caching layer, or a budget that holds not even one request (saying how much one needs).
    Pure: ``model`` is not modified.
    """
    check_model(model)
    kind = parse_strategy(strategy)
    check_positive("memory_bytes", memory_bytes)
    check_positive("max_model_len", max_model_len, upper=MAX_TOKENS)
    ratios = ratios_arg(pool_ratios)
    if ratios is not None and kind is not Strategy.POOLS:
        raise PlanError(
            f"pool_ratios: only the pools strategy takes ratios, got {list(ratios)} "
            f"with strategy {kind.value!r}"
        )
    options = PlanOptions(
        block_size=block_size,
        kernel_block_size=kernel_block_size,
        state_block_size=state_block_size,
        pool_ratios=ratios,
        chunk_alignment=chunk_alignment,
        state_split=state_split,
        one_slot_chunks=one_slot_chunks,
    )
    groups = group_entries(model)
    build = STRATEGIES[kind]
    split = options.state_split
    if split == AUTO_STATE_SPLIT:  # judged on the unsplit plan; the plan names what it used
        options = replace(options, state_split=1)
        try:
            layout, notes = build(groups, options, memory_bytes, max_model_len)
        except PlanError:  # no request fits whole: a cut arena may still hold one
            found = _cut_where_none_fits(kind, groups, options, memory_bytes, max_model_len)
            if found is None:
                raise  # the unsplit plan's error names the budget
            layout, notes, options = found
        sized = _sized(layout, max_model_len, memory_bytes)
        fit, waste = sized[0].max_concurrent_requests, sized[1].waste.total
        split, why = 1, ""  # a cut made above was the only plan that held a request
        if options.state_split == 1:
            split, why = _auto_split(layout, fit)  # 1 for pools and uniform (no arena)
        if split > 1:
            cut = split_state_groups(groups, split)
            try:
                cut_layout, cut_notes = build(cut, options, memory_bytes, max_model_len)
            except PlanError:  # the unsplit plan stands
                notes = (*notes, f"state_split auto: 1 (cut in {split}, no request fits)")
            else:  # kept unless it plans fewer requests, or wastes more than 1% and the unsplit
                cut_sized = _sized(cut_layout, max_model_len, memory_bytes)
                cut_fit = cut_sized[0].max_concurrent_requests
                cut_waste = cut_sized[1].waste.total
                if cut_fit >= fit and cut_waste <= max(waste, memory_bytes // 100):
                    layout, notes = cut_layout, (*cut_notes, f"state_split auto: {split} ({why})")
                    options = replace(options, state_split=split)
                    sized = cut_sized
                else:
                    notes = (
                        *notes,
                        f"state_split auto: 1 (cut in {split} it would plan {cut_fit} requests "
                        f"and waste {format_bytes(cut_waste)}, whole {fit} and "
                        f"{format_bytes(waste)})",
                    )
    else:
        assert isinstance(split, int)
        if split > 1 and kind is Strategy.UNIFORM:  # vLLM's grouping: the plan says 1
            options = replace(options, state_split=1)
        elif split > 1:
            groups = split_state_groups(groups, split)
        layout, notes = build(groups, options, memory_bytes, max_model_len)
        sized = _sized(layout, max_model_len, memory_bytes)
    capacity, ledger_ = sized
    return Plan(
        model=model,
        strategy=kind,
        memory_bytes=memory_bytes,
        max_model_len=max_model_len,
        options=options,
        layout=layout,
        capacity=capacity,
        waste=ledger_.waste,
        allocated_bytes=ledger_.allocated,
        free_bytes=ledger_.free,
        physical_need=PhysicalNeed.of(model, max_model_len, capacity.max_concurrent_requests),
        notes=(*notes, *_oversized_blocks(layout, max_model_len)),
    )


def _oversized_blocks(layout: MemoryLayout, max_model_len: int) -> tuple[str, ...]:
    """A note for each block size of a token-proportional group (attention, windows, MLA)
    larger than ``max_model_len``: no request fills such a block, so most of its bytes stay
    empty.  A state group's block size is a checkpoint interval, which may exceed it."""
    sizes = sorted(
        {
            g.block_size
            for g in layout.groups
            if not isinstance(g.spec, StateSpec) and g.block_size > max_model_len
        }
    )
    return tuple(
        f"block_size {size} tokens is more than max_model_len {max_model_len}: a request "
        f"fills at most {max_model_len / size:.0%} of each block it holds; a block_size of at "
        f"most {max_model_len} leaves less of it empty"
        for size in sizes
    )
