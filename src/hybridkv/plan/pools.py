"""The ``pools`` strategy: one pool per group, the budget split up front (SGLang, TRT-LLM).

Group ``g`` gets ``floor(memory * w[g] / sum(w))`` bytes, where ``w`` is ``pool_ratios`` (one
positive weight per group, normalised) or, by default, each group's bytes per max-length
request (``blocks_for_request * block_bytes``; windowed groups also count one prefill chunk of
``PREFILL_CHUNK_TOKENS`` in flight), so a workload of max-length requests fills every pool at
once.  Each pool holds ``share // block_bytes`` blocks; block 0 is its null
block.  Block sizes and pages are the unpadded ones of the ``arena`` strategy.  Capacity is
the minimum over pools: the split is fixed, so a workload of another shape strands memory in
the pools it does not need.

Example: a sliding group needing 10 blocks (+ 512 for a chunk in flight) and a full group
needing 8192 blocks of 384 KiB per request split 40 GiB as 522 : 8192.
"""

from __future__ import annotations

from fractions import Fraction

from hybridkv.errors import PlanError
from hybridkv.plan.accounting import too_small_error
from hybridkv.plan.grouping import BuiltLayout, SpecGroup, base_group_plans
from hybridkv.plan.layout import GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.plan.need import blocks_for_request
from hybridkv.plan.options import PlanOptions
from hybridkv.specs import CacheKind

__all__ = ["plan_pools", "pool_weights"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pool_weights(
    ratios: tuple[float, ...] | None, need_bytes: list[int], kinds: list[str]
) -> list[Fraction]:
    """Exact split weights: ``ratios`` if given (one per group), else ``need_bytes``.

    Raises :class:`PlanError` when the number of ratios is not the number of groups.
    """
    if ratios is None:
        return [Fraction(b) for b in need_bytes]
    if len(ratios) != len(need_bytes):
        groups = ", ".join(f"{i} {k}" for i, k in enumerate(kinds))
        raise PlanError(
            f"pool_ratios: got {len(ratios)} ratios {list(ratios)} for {len(need_bytes)} "
            f"groups ({groups}); give one positive ratio per group"
        )
    return [Fraction(r) for r in ratios]


#: Tokens of one prefill chunk in flight (the scheduler's default token budget).
PREFILL_CHUNK_TOKENS = 8192


def _split_need(group: GroupPlan, need: int, max_model_len: int) -> int:
    """Blocks a group is weighted by in the default split.

    A windowed group (sliding, chunked) must hold a whole prefill chunk on top of its window
    while the chunk runs; weighting it by its decode need alone would give it a pool too small
    to admit one chunk.  Other kinds: their need at ``max_model_len``.
    """
    if group.spec.kind in (CacheKind.SLIDING, CacheKind.CHUNKED):
        full = _cdiv(max_model_len, group.block_size)
        return min(full, need + _cdiv(PREFILL_CHUNK_TOKENS, group.block_size))
    return need


def plan_pools(
    groups: tuple[SpecGroup, ...], options: PlanOptions, memory_bytes: int, max_model_len: int
) -> BuiltLayout:
    """One pool per group (see the module docstring).  Pure.

    Raises :class:`PlanError` for bad ``pool_ratios`` or when some pool cannot hold even one
    request of ``max_model_len`` tokens (naming the smallest budget that would).
    """
    plans = base_group_plans(groups, options)
    need = [blocks_for_request(g, max_model_len) for g in plans]
    need_bytes = [
        _split_need(g, n, max_model_len) * g.block_bytes for n, g in zip(need, plans, strict=True)
    ]
    weights = pool_weights(options.pool_ratios, need_bytes, [g.spec.kind.value for g in plans])
    total = sum(weights)
    # floor(memory * w / W): Fractions are exact, so the split is reproducible.
    blocks = [
        int(memory_bytes * w / total) // g.block_bytes for g, w in zip(plans, weights, strict=True)
    ]
    fits = all(b - 1 >= n for b, n in zip(blocks, need, strict=True))
    if not fits:
        # floor(B * w / W) >= (1 + n) * block_bytes  <=>  B >= (1 + n) * block_bytes * W / w
        least = max(
            _cdiv_fraction((1 + n) * g.block_bytes * total / w)
            for g, n, w in zip(plans, need, weights, strict=True)
        )
        raise too_small_error(
            strategy=Strategy.POOLS.value,
            memory_bytes=memory_bytes,
            max_model_len=max_model_len,
            min_bytes=least,
            data_bytes=sum(len(g.members) * g.spec.resident_bytes(max_model_len) for g in groups),
            unit="block of every pool",
        )
    pools = tuple(
        PoolPlan(
            pool_id=g.group_id, group_ids=(g.group_id,), block_bytes=g.block_bytes, num_blocks=b
        )
        for g, b in zip(plans, blocks, strict=True)
    )
    split = "pool_ratios" if options.pool_ratios is not None else "need per max-length request"
    shares = ", ".join(f"{float(w / total):.4f}" for w in weights)
    note = f"pools: budget split by {split}: {shares}"
    layout = MemoryLayout(strategy=Strategy.POOLS, groups=plans, pools=pools)
    return BuiltLayout(layout, (note,))


def _cdiv_fraction(value: Fraction) -> int:
    return _cdiv(value.numerator, value.denominator)
