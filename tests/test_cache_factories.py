"""Small factories for cache-manager tests: tiny specs, hand-built layouts, request drivers.

Block bytes are kept equal across kinds where a test needs one uniform pool: every tiny spec
below stores 32 bytes per token (state: 128 bytes per slot), so with block size 4 every group
has 128-byte blocks per member.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import lcm

from hypothesis import strategies as hst

from hybridkv.cache import AllocationResult, ComputedBlocks, KVCacheManager, Request
from hybridkv.plan.layout import ArenaPlan, GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.specs import (
    CacheKind,
    CacheSpec,
    ChunkedLocalSpec,
    DType,
    FullAttentionSpec,
    MLASpec,
    SlidingWindowSpec,
    StateMixer,
    StateSpec,
    StateTensor,
)


def full() -> FullAttentionSpec:
    return FullAttentionSpec(num_kv_heads=1, head_dim=8, dtype=DType.FP16)


def swa(window: int, sinks: int = 0) -> SlidingWindowSpec:
    return SlidingWindowSpec(
        num_kv_heads=1, head_dim=8, dtype=DType.FP16, window=window, sink_tokens=sinks
    )


def chunked(chunk: int) -> ChunkedLocalSpec:
    return ChunkedLocalSpec(num_kv_heads=1, head_dim=8, dtype=DType.FP16, chunk_size=chunk)


def mla() -> MLASpec:
    return MLASpec(kv_lora_rank=12, qk_rope_head_dim=4, dtype=DType.FP16)


def state() -> StateSpec:
    tensor = StateTensor(name="ssm", shape=(64,), dtype=DType.FP16)
    return StateSpec(mixer=StateMixer.MAMBA2, tensors=(tensor,))


def group(gid: int, spec: CacheSpec, block_size: int = 4) -> GroupPlan:
    return GroupPlan(
        group_id=gid,
        spec=spec,
        members=((gid, 0),),
        block_size=block_size,
        kernel_block_size=block_size,
        page_bytes=spec.bytes_per_block(block_size),
    )


def groups(*items: CacheSpec | tuple[CacheSpec, int]) -> tuple[GroupPlan, ...]:
    """Groups in order; an item is a spec (block size 4) or ``(spec, block_size)``."""
    out = []
    for gid, item in enumerate(items):
        spec, bs = item if isinstance(item, tuple) else (item, 4)
        out.append(group(gid, spec, bs))
    return tuple(out)


def uniform(gs: Sequence[GroupPlan], num_blocks: int) -> MemoryLayout:
    bb = max(g.block_bytes for g in gs)
    ids = tuple(g.group_id for g in gs)
    pool = PoolPlan(pool_id=0, group_ids=ids, block_bytes=bb, num_blocks=num_blocks)
    return MemoryLayout(strategy=Strategy.UNIFORM, groups=tuple(gs), pools=(pool,))


def pools(gs: Sequence[GroupPlan], num_blocks: int | Sequence[int]) -> MemoryLayout:
    counts = [num_blocks] * len(gs) if isinstance(num_blocks, int) else list(num_blocks)
    plans = tuple(
        PoolPlan(
            pool_id=g.group_id, group_ids=(g.group_id,), block_bytes=g.block_bytes, num_blocks=n
        )
        for g, n in zip(gs, counts, strict=True)
    )
    return MemoryLayout(strategy=Strategy.POOLS, groups=tuple(gs), pools=plans)


def arena(
    gs: Sequence[GroupPlan], num_chunks: int, blocks_per_chunk: int = 2, *, tail: bool = False
) -> MemoryLayout:
    """Chunks of ``blocks_per_chunk`` blocks of the largest group (a multiple of all); with
    ``tail``, one byte short of another chunk past them (lent to a tail host)."""
    chunk = lcm(*(g.block_bytes for g in gs))
    chunk *= -(-max(g.block_bytes for g in gs) * blocks_per_chunk // chunk)
    plan = ArenaPlan(chunk_bytes=chunk, num_chunks=num_chunks, tail_bytes=chunk - 1 if tail else 0)
    return MemoryLayout(strategy=Strategy.ARENA, groups=tuple(gs), arena=plan)


def arena_bounded(gs: Sequence[GroupPlan], num_chunks: int) -> MemoryLayout:
    """Bounded chunks that the largest block does not divide (``2 * largest + 8`` bytes): the
    largest group gets one block per chunk, the others ``chunk // block - 1`` unless they
    divide it, and some block ids straddle two chunks."""
    chunk = 2 * max(g.block_bytes for g in gs) + 8
    plan = ArenaPlan(chunk_bytes=chunk, num_chunks=num_chunks)
    return MemoryLayout(strategy=Strategy.ARENA, groups=tuple(gs), arena=plan)


#: Strategies under test; ``arena_own`` is an arena layout with the ``own_first`` eviction,
#: ``arena_one`` one whose chunks hold one block of the largest group (the whole-chunk paths),
#: ``arena_bounded`` one whose chunks the blocks do not divide, ``arena_tail`` one with a
#: tail past the last chunk lent to one group for good.
STRATEGIES = (
    "uniform",
    "pools",
    "arena",
    "arena_own",
    "arena_one",
    "arena_bounded",
    "arena_tail",
)


def eviction_for(strategy: str) -> str:
    return "own_first" if strategy == "arena_own" else "chunk_lru"


def layout_for(strategy: str, gs: Sequence[GroupPlan], capacity: int) -> MemoryLayout:
    """About ``capacity`` usable blocks per group for any strategy in :data:`STRATEGIES`."""
    if strategy == "uniform":
        return uniform(gs, capacity * len(gs) + 1)
    if strategy == "pools":
        return pools(gs, capacity + 1)
    if strategy == "arena_one":
        return arena(gs, capacity * len(gs) + 1, blocks_per_chunk=1)
    if strategy == "arena_bounded":
        return arena_bounded(gs, capacity * len(gs) + 1)
    return arena(gs, capacity * len(gs) // 2 + 1, tail=strategy == "arena_tail")


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def admit(
    mgr: KVCacheManager, req: Request, budget: int | None = None
) -> tuple[ComputedBlocks, AllocationResult | None]:
    """get_computed_blocks + allocate_slots for the rest of the prompt (or ``budget``)."""
    hit = mgr.get_computed_blocks(req)
    n = req.num_tokens - hit.num_computed_tokens
    if budget is not None:
        n = min(n, budget)
    res = mgr.allocate_slots(
        req, n, num_new_computed_tokens=hit.num_computed_tokens, new_computed_blocks=hit
    )
    if res is not None:
        req.num_computed_tokens += hit.num_computed_tokens  # the scheduler counts the hit
    return hit, res


def step(req: Request, n: int) -> None:
    """The scheduler's bookkeeping after a step computed ``n`` tokens."""
    req.num_computed_tokens += n


def run_to_completion(mgr: KVCacheManager, req: Request, outputs: Sequence[int] = ()) -> None:
    """Admit, prefill in one step, decode ``outputs``, free.  Asserts every allocation fits."""
    _, res = admit(mgr, req)
    assert res is not None
    step(req, req.num_tokens - req.num_computed_tokens)
    for t in outputs:
        req.append_token_ids([t])
        assert mgr.allocate_slots(req, 1) is not None
        step(req, 1)
    mgr.free(req.request_id)


# -- hypothesis helpers and the brute-force oracle ----------------------------------------------


def spec_items() -> hst.SearchStrategy[tuple[CacheSpec, int]]:
    """A random tiny spec with a block size in {2, 4, 8}."""
    spec = hst.one_of(
        hst.just(full()),
        hst.just(mla()),
        hst.builds(swa, hst.integers(1, 12), hst.integers(0, 5)),
        hst.builds(chunked, hst.integers(2, 12)),
        hst.just(state()),
    )
    return hst.tuples(spec, hst.sampled_from([2, 4, 8]))


def cached_hashes(mgr: KVCacheManager) -> list[set[int]]:
    """Per group, the hashes its prefix cache holds (read from the pool)."""
    return [set(m) for m in mgr._coord.pool.maps]


def tier_hashes(mgr: KVCacheManager) -> list[set[int]]:
    """Per group, the hashes the lower tiers hold (empty sets without tiers)."""
    tiers = mgr._coord.tiers
    out: list[set[int]] = [set() for _ in mgr.layout.groups]
    if tiers is not None:
        for t in tiers.tiers:
            for g, keys in enumerate(t.keys):
                out[g] |= set(keys)
    return out


def serves(gp: GroupPlan, hashes: Sequence[int], hb: int, length: int, cached: set[int]) -> bool:
    """Naive rule: can group ``gp`` serve a hit of ``length`` tokens from ``cached``?"""
    if length == 0:
        return True
    if length % gp.block_size:
        return False
    k = gp.block_size // hb
    if gp.spec.kind is CacheKind.STATE:
        return hashes[length // hb - 1] in cached
    for span in gp.spec.kept_tokens(length):
        if not span:
            continue
        for j in range(span.start // gp.block_size, (span.stop - 1) // gp.block_size + 1):
            if hashes[(j + 1) * k - 1] not in cached:
                return False
    return True


def oracle(mgr: KVCacheManager, req: Request) -> tuple[int, list[int], list[list[int]]]:
    """Brute force: (hit, per-group standalone hits, per-group hit blocks)."""
    layout = mgr.layout
    hb, align = layout.hash_block_size, layout.schedule_alignment
    cached = [d | t for d, t in zip(cached_hashes(mgr), tier_hashes(mgr), strict=True)]
    hashes = req.block_hashes
    candidates = range(0, req.num_tokens, align)
    alone = [
        max(n for n in candidates if serves(gp, hashes, hb, n, cached[gp.group_id]))
        for gp in layout.groups
    ]
    hit = max(
        n
        for n in candidates
        if all(serves(gp, hashes, hb, n, cached[gp.group_id]) for gp in layout.groups)
    )
    maps = mgr._coord.pool.maps
    blocks: list[list[int]] = []
    for gp in layout.groups:
        k = gp.block_size // hb
        m = maps[gp.group_id]
        if gp.spec.kind is CacheKind.STATE:  # -1: read back from a lower tier
            blocks.append([m.get(hashes[hit // hb - 1], -1)] if hit else [])
            continue
        kept = {
            j
            for span in gp.spec.kept_tokens(hit)
            for j in range(span.start // gp.block_size, -(-span.stop // gp.block_size))
        }
        blocks.append(
            [
                m.get(hashes[(j + 1) * k - 1], -1) if j in kept else 0
                for j in range(hit // gp.block_size)
            ]
        )
    return hit, alone, blocks
