"""The ``pools`` strategy: one pool per group, the budget split up front (SGLang, TRT-LLM).

Group ``g`` gets ``floor(memory * w[g] / sum(w))`` bytes, where ``w`` is ``pool_ratios`` (one
positive weight per group, normalised) or, by default, each group's bytes per max-length
request (``blocks_for_request * block_bytes``; windowed groups also count one prefill chunk of
``PREFILL_CHUNK_TOKENS`` in flight, state groups one checkpoint slot being written), so a
workload of max-length requests fills every pool at once.  Each pool holds
``share // block_bytes`` blocks; block 0 is its null block.  Block sizes and pages are the
unpadded ones of the ``arena`` strategy.  Capacity is the minimum over pools: the split is
fixed, so a workload of another shape strands memory in the pools it does not need.

Example: a sliding group needing 10 blocks (+ 512 for a chunk in flight) and a full group
needing 8192 blocks of 384 KiB per request split 40 GiB as 522 : 8192.
"""

from __future__ import annotations

from fractions import Fraction

from hybridkv.errors import BudgetTooSmallError, PlanError, PoolRatiosError
from hybridkv.plan.grouping import BuiltLayout, SpecGroup, base_group_plans
from hybridkv.plan.layout import GroupPlan, MemoryLayout, PoolPlan, Strategy
from hybridkv.plan.need import blocks_for_request
from hybridkv.plan.options import PlanOptions
from hybridkv.specs import CacheKind
from hybridkv.units import MAX_BYTES, format_bytes, format_bytes_exact

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
        groups = ", ".join(f"group {i}: {k}" for i, k in enumerate(kinds))
        raise PoolRatiosError(
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


def _pool_need(group: GroupPlan, need: int) -> int:
    """Blocks one request must be able to hold in its group's own pool.

    A state group's request holds its running slot plus, while a checkpoint is being written,
    the checkpoint's slot (published at the request's next call): a pool of one usable slot
    could never run a request past its first checkpoint boundary.
    """
    return need + 1 if group.spec.kind is CacheKind.STATE else need


def plan_pools(
    groups: tuple[SpecGroup, ...], options: PlanOptions, memory_bytes: int, max_model_len: int
) -> BuiltLayout:
    """One pool per group (see the module docstring).  Pure.

    Raises :class:`PlanError` for bad ``pool_ratios`` or when some pool cannot hold even one
    request of ``max_model_len`` tokens (naming the smallest budget that would).
    """
    plans = base_group_plans(groups, options)
    need = [_pool_need(g, blocks_for_request(g, max_model_len)) for g in plans]
    need_bytes = [
        _split_need(g, n, max_model_len) * g.block_bytes for n, g in zip(need, plans, strict=True)
    ]
    weights = pool_weights(options.pool_ratios, need_bytes, [g.spec.kind.value for g in plans])
    total = sum(weights)
    # floor(memory * w / W): Fractions are exact, so the split is reproducible.
    blocks = [
        int(memory_bytes * w / total) // g.block_bytes for g, w in zip(plans, weights, strict=True)
    ]
    short = [(g, b, n) for g, b, n in zip(plans, blocks, need, strict=True) if b - 1 < n]
    if short:
        # floor(B * w / W) >= (1 + n) * block_bytes  <=>  B >= (1 + n) * block_bytes * W / w
        least = max(
            _cdiv_fraction((1 + n) * g.block_bytes * total / w)
            for g, n, w in zip(plans, need, weights, strict=True)
        )
        data = sum(len(g.members) * g.spec.resident_bytes(max_model_len) for g in groups)
        split = _split_text(options, weights, plans)
        # the caller's ratios are to blame where some split of this budget would do
        some_split = sum((1 + n) * g.block_bytes for g, n in zip(plans, need, strict=True))
        blame = options.pool_ratios is not None and some_split <= memory_bytes
        raise _split_error(short, memory_bytes, max_model_len, least, data, split, blame)
    pools = tuple(
        PoolPlan(
            pool_id=g.group_id, group_ids=(g.group_id,), block_bytes=g.block_bytes, num_blocks=b
        )
        for g, b in zip(plans, blocks, strict=True)
    )
    note = f"pools: budget split {_split_text(options, weights, plans)}"
    layout = MemoryLayout(strategy=Strategy.POOLS, groups=plans, pools=pools)
    return BuiltLayout(layout, (note,))


def _split_text(
    options: PlanOptions, weights: list[Fraction], plans: tuple[GroupPlan, ...] | list[GroupPlan]
) -> str:
    """How the budget was split, e.g. ``by --pool-ratios: g0 sliding_window 0.2500, ...``."""
    total = sum(weights)
    shares = ", ".join(
        f"g{g.group_id} {g.spec.kind.value} {float(w / total):.4f}"
        for g, w in zip(plans, weights, strict=True)
    )
    if options.pool_ratios is not None:
        return f"by pool_ratios: {shares}"
    windowed = any(g.spec.kind in (CacheKind.SLIDING, CacheKind.CHUNKED) for g in plans)
    chunk = (
        f" (windowed groups: their window plus one {PREFILL_CHUNK_TOKENS}-token prefill chunk)"
        if windowed
        else ""
    )
    return f"by each group's need per max-length request{chunk}: {shares}"


def _split_error(
    short: list[tuple[GroupPlan, int, int]],
    memory_bytes: int,
    max_model_len: int,
    least: int,
    data_bytes: int,
    split: str,
    blame_ratios: bool,
) -> PlanError:
    """The refusal of a split that leaves some pool too small for one request.  Where the
    caller's own ``pool_ratios`` are what is wrong (another split of this budget would hold a
    request), the message names them first and says what share each starved group needs."""
    starved = "; ".join(
        f"group {g.group_id} ({g.spec.kind.value}) gets {max(b - 1, 0)} usable blocks of "
        f"{format_bytes(g.block_bytes)} and needs {n}"
        for g, b, n in short
    )
    huge = least > MAX_BYTES  # a ratio so small no machine's memory would do
    needs = "more than any machine addresses" if huge else f"at least {format_bytes_exact(least)}"
    if blame_ratios:
        shares = ", ".join(
            f"group {g.group_id} at least {(1 + n) * g.block_bytes / memory_bytes:.4g}"
            for g, _, n in short
        )
        return BudgetTooSmallError(
            f"pool_ratios: the fixed split {split} starves a pool of the "
            f"{format_bytes(memory_bytes)} budget: {starved}, so no request of max_model_len "
            f"{max_model_len} fits (this split needs {needs}); give ratios whose shares of the "
            f"total are {shares} here, or leave --pool-ratios out (the split then follows each "
            "group's need)",
            0 if huge else least,
        )
    return BudgetTooSmallError(
        f"memory_bytes: {format_bytes_exact(memory_bytes)} holds no request of "
        f"max_model_len {max_model_len} with the pools strategy: the fixed split {split} "
        f"starves a pool: {starved}; this split needs {needs} although one request's cache "
        f"data is only {format_bytes(data_bytes)}; give more memory, a shorter max_model_len, "
        "pool ratios that match the need (--pool-ratios), or the arena strategy, which has no "
        "fixed split",
        0 if huge else least,
    )


def _cdiv_fraction(value: Fraction) -> int:
    return _cdiv(value.numerator, value.denominator)
