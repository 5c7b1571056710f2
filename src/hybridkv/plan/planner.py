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

from hybridkv.errors import PlanError
from hybridkv.plan.accounting import arena_capacity, ledger, pool_capacity
from hybridkv.plan.arena import plan_arena
from hybridkv.plan.grouping import BuiltLayout, SpecGroup, group_entries, split_state_groups
from hybridkv.plan.layout import MemoryLayout, Strategy
from hybridkv.plan.need import blocks_for_request
from hybridkv.plan.options import DEFAULT_CHUNK_ALIGNMENT, PlanOptions, check_positive
from hybridkv.plan.pools import plan_pools
from hybridkv.plan.result import Capacity, PhysicalNeed, Plan
from hybridkv.plan.uniform import plan_uniform
from hybridkv.specs import MAX_TOKENS, ModelSpec

__all__ = ["make_plan", "parse_strategy"]

_Builder = Callable[[tuple[SpecGroup, ...], PlanOptions, int, int], BuiltLayout]

#: strategy -> layout builder ``(groups, options, memory_bytes, max_model_len)``.
STRATEGIES: dict[Strategy, _Builder] = {
    Strategy.ARENA: plan_arena,
    Strategy.UNIFORM: plan_uniform,
    Strategy.POOLS: plan_pools,
}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


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
        n = arena_capacity(per_chunk, layout.arena.num_chunks - 1, need)
        in_use = tuple(n * b for b in need)
        return Capacity(
            max_concurrent_requests=n,
            max_resident_tokens=n * max_model_len,
            blocks_per_request=need,
            blocks_in_use=in_use,
            num_chunks=layout.arena.num_chunks,
            blocks_per_chunk=per_chunk,
            chunks_in_use=tuple(_cdiv(u, p) for u, p in zip(in_use, per_chunk, strict=True)),
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
    state_split: int = 1,
) -> Plan:
    """Plan ``model``'s cache in ``memory_bytes`` bytes for requests of ``max_model_len`` tokens.

    ``block_size`` (tokens) applies to attention/MLA groups, ``state_block_size`` (tokens, the
    checkpoint interval) to state groups, ``kernel_block_size`` (tokens, must divide
    ``block_size``) to attention kernels; ``pool_ratios`` (``pools`` only) weigh the pools;
    ``chunk_alignment`` (bytes) is the arena chunk granularity; ``state_split`` cuts each
    state group into that many groups of layers (``arena`` and ``pools``).  See
    :mod:`hybridkv.plan.options` for the defaults.

    Raises :class:`PlanError` naming the field for a non-positive budget, length or block size,
    a kernel block size that does not divide the block size, bad ratios, a model with no
    caching layer, or a budget that holds not even one request (saying how much one needs).
    Pure: ``model`` is not modified.
    """
    kind = parse_strategy(strategy)
    check_positive("memory_bytes", memory_bytes)
    check_positive("max_model_len", max_model_len, upper=MAX_TOKENS)
    if isinstance(pool_ratios, str | bytes):
        raise PlanError(f"pool_ratios: expected a sequence of numbers, got {pool_ratios!r}")
    if pool_ratios is not None and kind is not Strategy.POOLS:
        raise PlanError(
            f"pool_ratios: only the pools strategy takes ratios, got {list(pool_ratios)} "
            f"with strategy {kind.value!r}"
        )
    options = PlanOptions(
        block_size=block_size,
        kernel_block_size=kernel_block_size,
        state_block_size=state_block_size,
        pool_ratios=None if pool_ratios is None else tuple(pool_ratios),
        chunk_alignment=chunk_alignment,
        state_split=state_split,
    )
    groups = group_entries(model)
    if options.state_split > 1 and kind is not Strategy.UNIFORM:
        groups = split_state_groups(groups, options.state_split)
    layout, notes = STRATEGIES[kind](groups, options, memory_bytes, max_model_len)
    need = tuple(blocks_for_request(g, max_model_len) for g in layout.groups)
    capacity = _capacity(layout, need, max_model_len)
    ledger_ = ledger(layout, need, capacity.max_concurrent_requests, memory_bytes)
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
        notes=notes,
    )
