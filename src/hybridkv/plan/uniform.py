"""The ``uniform`` strategy: vLLM's hybrid allocator rules, reproduced for comparison.

1. **Equal pages.**  Every member page has the same byte size ``P``.
   * With state groups, vLLM raises the attention block size to the smallest multiple of
     ``A`` tokens whose page holds the largest state: ``A * cdiv(state, A * bytes_per_token)``
     (``A`` = 16, the kernel alignment; ``lcm(16, kernel_block_size)`` when one is given), unless
     ``block_size`` is already larger.  ``bytes_per_token`` is the largest among the attention
     groups.
   * ``P`` is that attention page (or the largest state page in a model without attention).
     Attention groups with fewer bytes per token get a block size scaled by
     ``largest / theirs`` so their page is ``P`` too.  (vLLM stops with an error when that
     ratio is not an integer; here the scale is rounded down and the page padded to ``P``.)
   * State pages are padded up to ``P`` ("Padding mamba page size by X%").
   * ``P`` is rounded up to a multiple of the largest element size of any group (a page
     that is not one leaves the next member's tensors misaligned; every catalog model's
     ``P`` already is one).
   * State groups checkpoint at the unified attention block size (vLLM's align mode) unless
     ``state_block_size`` is given; without attention, at 256 tokens.
2. **Equal layer counts.**  ``group_size`` is the smallest member count among the specs, or
   the largest when it is below 1.5 times the smallest.  Each spec's members are split in
   order into groups of ``group_size``; the last one is padded with unused layer slots
   (``padded_members``), because vLLM's KV tensor ``i`` serves slot ``i`` of every group.
3. **One pool.**  ``block_bytes = P * group_size``, ``num_blocks = memory // block_bytes``,
   block 0 is the null block; every group's block ids come from it.

Example: 13 layers in a 5:1 sliding/full pattern give 11 sliding and 2 full entries;
``group_size`` = 2, so sliding splits into 2,2,2,2,2,1 (+1 padded slot) and full into one
group of 2: seven groups of two slots.
"""

from __future__ import annotations

import logging
from math import lcm

from hybridkv.plan.accounting import too_small_error
from hybridkv.plan.grouping import (
    TOKEN_KINDS,
    BuiltLayout,
    SpecGroup,
    element_alignment,
    is_state,
)
from hybridkv.plan.layout import GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.plan.need import spec_blocks_for_request
from hybridkv.plan.options import DEFAULT_STATE_BLOCK_SIZE, PlanOptions, kernel_block_size_for

__all__ = ["LAYER_COUNT_SLACK", "UNIFORM_KERNEL_ALIGNMENT", "plan_uniform", "uniform_group_size"]

logger = logging.getLogger(__name__)

#: vLLM's kernel block alignment for the attention block raised to hold a state (tokens).
UNIFORM_KERNEL_ALIGNMENT = 16
#: Use the largest member count as group size when it is below this times the smallest.
LAYER_COUNT_SLACK = 1.5


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def uniform_group_size(counts: list[int]) -> int:
    """vLLM's layers per group for member counts ``counts`` (one per distinct spec)."""
    smallest, largest = min(counts), max(counts)
    return largest if largest < LAYER_COUNT_SLACK * smallest else smallest


def _page_and_block_sizes(
    groups: tuple[SpecGroup, ...], options: PlanOptions
) -> tuple[int, list[int]]:
    """The unified page ``P`` (bytes) and each spec group's block size (tokens)."""
    token = [g for g in groups if g.spec.kind in TOKEN_KINDS]
    state_page = max((g.spec.state_bytes for g in groups if is_state(g.spec)), default=0)
    bs = options.block_size
    if token:
        per_token = max(g.spec.bytes_per_token for g in token)
        align = lcm(UNIFORM_KERNEL_ALIGNMENT, options.kernel_block_size or 1)
        if bs * per_token < state_page:
            bs = align * _cdiv(state_page, align * per_token)
        page = bs * per_token
        state_bs = options.state_block_size or bs
    else:
        page = state_page
        state_bs = options.state_block_size or DEFAULT_STATE_BLOCK_SIZE
    sizes = [
        state_bs if is_state(g.spec) else bs * (page // (bs * g.spec.bytes_per_token))
        for g in groups
    ]
    align = max(element_alignment(g.spec) for g in groups)
    return _cdiv(page, align) * align, sizes


def plan_uniform(
    groups: tuple[SpecGroup, ...], options: PlanOptions, memory_bytes: int, max_model_len: int
) -> BuiltLayout:
    """vLLM-style layout for ``groups`` (see the module docstring).  Pure.

    Raises :class:`PlanError` when not even one request of ``max_model_len`` tokens fits.
    """
    page, sizes = _page_and_block_sizes(groups, options)
    group_size = uniform_group_size([len(g.members) for g in groups])
    plans: list[GroupPlan] = []
    for group, bs in zip(groups, sizes, strict=True):
        kernel = kernel_block_size_for(group.spec, bs, options.kernel_block_size)
        for start in range(0, len(group.members), group_size):
            members = group.members[start : start + group_size]
            plans.append(
                GroupPlan(
                    group_id=len(plans),
                    spec=group.spec,
                    members=members,
                    block_size=bs,
                    kernel_block_size=kernel,
                    page_bytes=page,
                    padded_members=group_size - len(members),
                )
            )
    notes = _notes(groups, plans, options, page, group_size)
    for note in notes:
        logger.info("%s", note)
    block_bytes = page * group_size
    need = sum(spec_blocks_for_request(p.spec, p.block_size, max_model_len) for p in plans)
    num_blocks = memory_bytes // block_bytes
    if num_blocks - 1 < need:
        raise too_small_error(
            strategy=Strategy.UNIFORM.value,
            memory_bytes=memory_bytes,
            max_model_len=max_model_len,
            min_bytes=(1 + need) * block_bytes,
            data_bytes=sum(len(g.members) * g.spec.resident_bytes(max_model_len) for g in groups),
            unit="block",
        )
    pool = PoolPlan(
        pool_id=0,
        group_ids=tuple(range(len(plans))),
        block_bytes=block_bytes,
        num_blocks=num_blocks,
    )
    layout = MemoryLayout(strategy=Strategy.UNIFORM, groups=tuple(plans), pools=(pool,))
    return BuiltLayout(layout, notes)


def _notes(
    groups: tuple[SpecGroup, ...],
    plans: list[GroupPlan],
    options: PlanOptions,
    page: int,
    group_size: int,
) -> tuple[str, ...]:
    notes: list[str] = []
    raised = sorted({p.block_size for p in plans if not is_state(p.spec)} - {options.block_size})
    if raised:
        notes.append(
            f"uniform: attention block size raised from {options.block_size} to "
            f"{', '.join(map(str, raised))} tokens so every page is {page} B"
        )
    for g in groups:
        if is_state(g.spec) and g.spec.state_bytes < page:
            notes.append(
                f"uniform: {g.spec.state_bytes} B state pages padded to {page} B "
                f"(+{100 * (page - g.spec.state_bytes) / g.spec.state_bytes:.1f}%)"
            )
    padded = sum(p.padded_members for p in plans)
    if padded:
        notes.append(
            f"uniform: {len(plans)} groups of {group_size} layer slots, {padded} of them padded; "
            f"may waste up to {100 * padded / (len(plans) * group_size):.1f}% of the pool"
        )
    return tuple(notes)
