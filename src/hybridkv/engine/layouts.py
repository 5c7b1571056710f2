"""A fixed-size memory layout for a model spec: one pool of ``num_blocks`` blocks per group.

The planner (:mod:`hybridkv.plan`) sizes layouts for a memory budget; the runner's tests only
need a small layout with chosen block sizes, which :func:`fixed_layout` builds directly: cache
entries with equal specs form one group (in layer order of first appearance), token groups get
``block_size`` / ``kernel_block_size``, state groups ``state_block_size`` (the checkpoint
interval; kernel size = block size).
"""

from __future__ import annotations

from hybridkv.engine.errors import BindingError
from hybridkv.plan import GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.specs import CacheKind, CacheSpec, ModelSpec

__all__ = ["fixed_layout"]


def fixed_layout(
    spec: ModelSpec,
    *,
    block_size: int = 4,
    kernel_block_size: int | None = None,
    state_block_size: int | None = None,
    num_blocks: int = 64,
) -> MemoryLayout:
    """A ``pools`` layout of ``spec``: one pool of ``num_blocks`` blocks (null block included)
    per group.  Raises :class:`BindingError` when the model caches nothing, and
    :class:`~hybridkv.errors.PlanError` for inconsistent sizes (e.g. a kernel block size that
    does not divide the block size)."""
    members: dict[CacheSpec, list[tuple[int, int]]] = {}
    for layer, slot, cache in spec.entries():
        members.setdefault(cache, []).append((layer, slot))
    if not members:
        raise BindingError(f"layout: model {spec.name!r} caches nothing; no layout to build")
    groups: list[GroupPlan] = []
    for gid, (cache, entries) in enumerate(members.items()):
        is_state = cache.kind is CacheKind.STATE
        size = (state_block_size or block_size) if is_state else block_size
        kernel = size if is_state or kernel_block_size is None else kernel_block_size
        groups.append(
            GroupPlan(
                group_id=gid,
                spec=cache,
                members=tuple(entries),
                block_size=size,
                kernel_block_size=kernel,
                page_bytes=cache.bytes_per_block(size),
            )
        )
    pools = tuple(
        PoolPlan(
            pool_id=g.group_id,
            group_ids=(g.group_id,),
            block_bytes=g.block_bytes,
            num_blocks=num_blocks,
        )
        for g in groups
    )
    return MemoryLayout(strategy=Strategy.POOLS, groups=tuple(groups), pools=pools)
