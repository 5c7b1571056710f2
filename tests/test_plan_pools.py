"""The pools strategy: a fixed split of the budget, one pool per group."""

from __future__ import annotations

import pytest

from hybridkv.errors import BudgetTooSmallError, PlanError
from hybridkv.plan import make_plan
from test_plan_factories import swa_full_model


def _pools(memory: int, ratios: tuple[float, ...] | None = None):  # type: ignore[no-untyped-def]
    return make_plan(
        swa_full_model(),
        memory_bytes=memory,
        max_model_len=32,
        block_size=4,
        strategy="pools",
        pool_ratios=ratios,
    )


def test_split_proportional_to_need() -> None:
    # Need per request: 4 sliding + 8 full blocks of 256 bytes.  The sliding group also holds a
    # prefill chunk in flight, capped at max_model_len (32 tokens = 8 blocks): shares 1/2, 1/2.
    plan = _pools(17384)
    pools = plan.layout.pools
    assert [(p.pool_id, p.group_ids, p.block_bytes) for p in pools] == [
        (0, (0,), 256),
        (1, (1,), 256),
    ]
    assert [p.num_blocks for p in pools] == [8692 // 256, 8692 // 256]  # 33, 33
    assert plan.capacity.pool_blocks == (33, 33)
    assert plan.capacity.max_concurrent_requests == 4  # min(32 // 4, 32 // 8)
    assert plan.waste.reserved == 512
    assert plan.waste.chunk_tails == 17384 - 66 * 256
    assert plan.free_bytes == (32 - 16) * 256
    assert plan.allocated_bytes + plan.waste.total + plan.free_bytes == 17384


def test_given_ratios_are_normalised() -> None:
    plan = _pools(17384, (1.0, 1.0))
    assert [p.num_blocks for p in plan.layout.pools] == [33, 33]
    assert plan.capacity.max_concurrent_requests == 4  # min(32 // 4, 32 // 8)
    assert _pools(17384, (0.5, 0.5)).layout == plan.layout


def test_wrong_ratio_count_names_the_groups() -> None:
    with pytest.raises(
        PlanError,
        match=r"pool_ratios: got 3 ratios .* for 2 groups \(group 0: sliding_window, group 1: full",
    ):
        _pools(17384, (1.0, 2.0, 3.0))


def test_negative_ratio() -> None:
    with pytest.raises(PlanError, match="pool_ratios: every ratio must be a positive"):
        _pools(17384, (1.0, -2.0))


def test_budget_too_small_names_the_smallest_budget() -> None:
    # Pool 1 needs (1 + 8) * 256 bytes at 1/2 of the budget: 4608 bytes.
    with pytest.raises(
        PlanError,
        match=r"starves a pool: group 1 \(full_attention\) gets 7 usable blocks of 256 B and "
        r"needs 8; this split needs at least 4.5 KiB \(4608 B\) although one request's cache "
        r"data is only 2.5 KiB",
    ):
        _pools(4607)
    assert _pools(4608).capacity.max_concurrent_requests == 1


def test_ratios_that_starve_a_pool_are_named_with_the_share_it_needs() -> None:
    # Group 0 (sliding) needs 4 blocks plus the null block: 5 * 256 B, a share of at least
    # 1280 / 17384 = 0.07363 of this budget; ratios 1:100 give it 172 B, no block.  Another
    # split of the budget would hold a request, so the ratios are to blame.
    with pytest.raises(BudgetTooSmallError) as info:
        _pools(17384, (1.0, 100.0))
    assert str(info.value).startswith(
        "pool_ratios: the fixed split by pool_ratios: g0 sliding_window 0.0099, g1 "
        "full_attention 0.9901 starves a pool of the 17 KiB budget: group 0 (sliding_window) "
        "gets 0 usable blocks of 256 B and needs 4, so no request of max_model_len 32 fits "
        "(this split needs at least 126 KiB (129280 B)); give ratios whose shares of the total "
        "are group 0 at least 0.07363 here"
    )
    assert info.value.least_bytes == 129280
    assert _pools(129280, (1.0, 100.0)).capacity.max_concurrent_requests >= 1
    # No split of 3,000 B holds one request (5 + 9 blocks of 256 B): the budget is to blame.
    with pytest.raises(BudgetTooSmallError, match=r"^memory_bytes: 2.93 KiB \(3000 B\) holds"):
        _pools(3000, (1.0, 100.0))
    # A ratio so small that no memory would do: refused without an absurd byte count.
    with pytest.raises(BudgetTooSmallError, match="this split needs more than any machine") as huge:
        _pools(17384, (1e-300, 1.0))
    assert huge.value.least_bytes == 0


def test_state_pool_holds_a_checkpoint_in_flight() -> None:
    # A state request holds its running slot and, until its next call, the checkpoint being
    # written: its pool needs two usable slots (plus the null slot) for one request.
    from hybridkv.models import resolve_model
    from hybridkv.plan import make_plan

    model = resolve_model("Qwen3-Next-80B-A3B")
    plan = make_plan(model, memory_bytes=8 << 30, max_model_len=131072, strategy="pools")
    state_pool = plan.layout.pools[0]
    assert plan.layout.groups[0].spec.kind.value == "state"
    assert state_pool.num_blocks - 1 >= 2
