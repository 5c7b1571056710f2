"""Small factories shared by the storage tests (plus a check that they build valid layouts)."""

from __future__ import annotations

from math import lcm

import pytest

from hybridkv.plan import ArenaPlan, GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.specs import (
    CacheSpec,
    ChunkedLocalSpec,
    FullAttentionSpec,
    MLASpec,
    SlidingWindowSpec,
    StateMixer,
    StateSpec,
    StateTensor,
)
from hybridkv.storage import LayoutKind

BLOCK = 4

SPECS: dict[str, CacheSpec] = {
    "full": FullAttentionSpec(num_kv_heads=2, head_dim=8, dtype="bf16"),
    "swa": SlidingWindowSpec(num_kv_heads=2, head_dim=8, dtype="fp16", window=8),
    "chunked": ChunkedLocalSpec(num_kv_heads=1, head_dim=16, dtype="fp32", chunk_size=8),
    "kv_dims": FullAttentionSpec(num_kv_heads=4, head_dim=8, v_head_dim=4, dtype="fp8"),
    "mla": MLASpec(kv_lora_rank=12, qk_rope_head_dim=4, dtype="bf16"),
    "state": StateSpec(
        mixer=StateMixer.MAMBA2,
        tensors=(
            StateTensor(name="conv", shape=(3, 8), dtype="bf16"),
            StateTensor(name="ssm", shape=(2, 4, 4), dtype="fp32"),
        ),
    ),
}

STRATEGIES = ("arena", "pools", "uniform")
KINDS = tuple(LayoutKind)


def group(
    gid: int,
    spec: CacheSpec,
    layers: tuple[int, ...],
    *,
    block_size: int = BLOCK,
    kernel_block_size: int | None = None,
    page_bytes: int | None = None,
    padded: int = 0,
    slot: int = 0,
) -> GroupPlan:
    return GroupPlan(
        group_id=gid,
        spec=spec,
        members=tuple((layer, slot) for layer in layers),
        block_size=block_size,
        kernel_block_size=kernel_block_size or block_size,
        page_bytes=page_bytes or spec.bytes_per_block(block_size),
        padded_members=padded,
    )


def arena_layout(
    groups: tuple[GroupPlan, ...], *, num_chunks: int = 4, per: int = 2
) -> MemoryLayout:
    chunk = lcm(*(g.block_bytes for g in groups)) * per
    return MemoryLayout(
        strategy=Strategy.ARENA,
        groups=groups,
        arena=ArenaPlan(chunk_bytes=chunk, num_chunks=num_chunks),
    )


def pools_layout(
    groups: tuple[GroupPlan, ...], *, num_blocks: int = 6, extra: int = 0
) -> MemoryLayout:
    pools = tuple(
        PoolPlan(
            pool_id=i, group_ids=(i,), block_bytes=g.block_bytes + extra, num_blocks=num_blocks
        )
        for i, g in enumerate(groups)
    )
    return MemoryLayout(strategy=Strategy.POOLS, groups=groups, pools=pools)


def uniform_layout(groups: tuple[GroupPlan, ...], *, num_blocks: int = 8) -> MemoryLayout:
    """vLLM-style: pad every group to the largest page and the largest slot count."""
    page = max(g.page_bytes for g in groups)
    page = -(-page // 16) * 16
    slots = max(g.num_members for g in groups)
    padded = tuple(
        GroupPlan(
            group_id=g.group_id,
            spec=g.spec,
            members=g.members,
            block_size=g.block_size,
            kernel_block_size=g.kernel_block_size,
            page_bytes=page,
            padded_members=slots - g.num_members,
        )
        for g in groups
    )
    pool = PoolPlan(
        pool_id=0,
        group_ids=tuple(range(len(groups))),
        block_bytes=page * slots,
        num_blocks=num_blocks,
    )
    return MemoryLayout(strategy=Strategy.UNIFORM, groups=padded, pools=(pool,))


def equal_slots(groups: tuple[GroupPlan, ...]) -> tuple[GroupPlan, ...]:
    """Pad groups to one slot count (what per_layer on the arena needs)."""
    slots = max(g.num_members + g.padded_members for g in groups)
    return tuple(
        GroupPlan(
            group_id=g.group_id,
            spec=g.spec,
            members=g.members,
            block_size=g.block_size,
            kernel_block_size=g.kernel_block_size,
            page_bytes=g.page_bytes,
            padded_members=slots - g.num_members,
        )
        for g in groups
    )


def mixed_groups() -> tuple[GroupPlan, ...]:
    """One group per spec kind, layers numbered in order, 1-2 members each."""
    out = []
    layer = 0
    for gid, spec in enumerate(SPECS.values()):
        members = 2 if gid % 2 == 0 else 1
        out.append(group(gid, spec, tuple(range(layer, layer + members))))
        layer += members
    return tuple(out)


def build(strategy: str, groups: tuple[GroupPlan, ...], *, num_chunks: int = 4) -> MemoryLayout:
    if strategy == "arena":
        return arena_layout(equal_slots(groups), num_chunks=num_chunks)
    if strategy == "pools":
        return pools_layout(groups, extra=32)
    return uniform_layout(groups)


def owned_ids(layout: MemoryLayout, gid: int, part: int) -> list[int]:
    """Block ids group ``gid`` may use without touching another group's (``part`` 0 or 1).

    Arena: chunk ``1 + 2 * gid + part``; uniform: ids ``b`` with ``b % (2 * groups)`` equal to
    ``2 * gid + part``; pools: the first or second half of the pool.
    """
    if layout.arena is not None:
        per = layout.blocks_per_chunk(gid)
        chunk = 1 + 2 * gid + part
        return list(range(chunk * per, (chunk + 1) * per))
    n = layout.pool_of(gid).num_blocks
    if layout.strategy is Strategy.UNIFORM:
        k = 2 * len(layout.groups)
        return [b for b in range(1, n) if b % k == 2 * gid + part]
    half = (n - 1) // 2
    return list(range(1 + part * half, 1 + (part + 1) * half))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_factories_build_valid_layouts(strategy: str) -> None:
    layout = build(strategy, mixed_groups())
    assert layout.strategy.value == strategy
    assert len(layout.groups) == len(SPECS)
